"""The finetune report's step time: a prediction is compared only with a step measured on the
device it was made for (the plan's GPU under `device: cuda`, the device that ran for the
preflight's calibrated plan); a `device: cpu` trial without one prints no ratio."""

from megatron_omnibal.workflow.report import render, step_time


def _report(device, preflight=None, measured=9348.8):
    return {"output": "out", "device": device, "preflight": preflight,
            "plan": {"file": "plan.json", "hardware": "A100-80G", "tp": 1, "pp": 2, "dp": 1,
                     "micro_batches": 2, "predicted_step_ms": 0.5088},
            "train": {"checkpoint": "ckpt", "iteration": None, "measured_step_ms": measured,
                      "first_loss": None, "last_loss": None, "loss_png": None},
            "export": None, "compare_hf": None}


def test_a_cpu_trial_is_not_compared_with_the_gpu_plan():
    report = _report("cpu")
    report["step_time"] = step_time(report)
    assert report["step_time"] == {"predicted_ms": None, "basis": None, "measured_ms": 9348.8,
                                   "ratio": None}
    text = render(report)
    assert "measured/predicted" not in text
    assert ("measured 9348.8 ms on cpu (median of the logged iterations); the plan predicts "
            "0.5 ms for A100-80G, a different device: not compared") in text


def test_the_calibrated_prediction_is_compared_on_the_device_that_ran():
    preflight = {"ok": True, "step_ms": {"planned": 0.5088, "measured": 9000.0},
                 "calibrated_step_ms": 9100.0, "file": "preflight.json"}
    report = _report("cpu", preflight)
    report["step_time"] = step_time(report)
    assert report["step_time"]["ratio"] == 9348.8 / 9100.0
    assert ("predicted 9100.0 ms (the preflight's calibrated plan, for this device), measured "
            "9348.8 ms on cpu (median of the logged iterations), measured/predicted 1.03"
            ) in render(report)


def test_a_gpu_run_is_compared_with_the_plans_model():
    report = _report("cuda", measured=0.61)
    report["step_time"] = step_time(report)
    assert report["step_time"]["ratio"] == 0.61 / 0.5088
    assert ("predicted 0.5 ms (the plan, modeled for A100-80G), measured 0.6 ms on cuda "
            "(median of the logged iterations), measured/predicted 1.20") in render(report)
