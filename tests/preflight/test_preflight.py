"""`python -m megatron_omnibal.preflight`: the plan's own stages measured for a few steps.

Pieces against oracles in-process (the saved-tensor tracker against bytes counted by hand, the
largest micro-batch of each level, the report's verdicts); then real torchrun runs with gloo on
CPU: a PP=2 plan that fits passes with the plan's figures beside the measured ones; a device
memory between two stages' peaks fails exactly the larger one (PP=2 and PP=3, where the middle
stage is the heavy one), names it, its micro-batch and a recompute, and that recompute, run
again at the same limit, fits.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_omnibal.balance.config import Level
from megatron_omnibal.data.lengths import load_lengths
from megatron_omnibal.preflight.measure import SavedTensorTracker
from megatron_omnibal.preflight.packs import worst_packs
from megatron_omnibal.preflight.report import Limits, build_report

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "helpers" / "megatron_workers"))


def test_tracker_counts_each_saved_storage_once_until_the_graph_is_freed() -> None:
    weight = torch.randn(64, 32, requires_grad=True)
    tracker = SavedTensorTracker(exclude=[weight.untyped_storage().data_ptr()])
    x = torch.randn(10, 64, requires_grad=True)
    with tracker.hooks():
        h = x.exp()  # saves its result: 10 x 64 float32
        y = h.sin()  # saves its input, the same storage: counted once
        z = y @ weight  # saves y (10 x 64) and the weight (a parameter: excluded)
        loss = z.sum()
    assert tracker.bytes == tracker.peak == 2 * 10 * 64 * 4
    loss.backward()
    del h, y, z, loss
    assert tracker.bytes == 0 and tracker.peak == 2 * 10 * 64 * 4 and not tracker.live


def test_worst_pack_fills_both_budgets_of_each_level() -> None:
    levels = (Level(vit_budget=16, token_budget=160, micro_batches=4),
              Level(vit_budget=16, token_budget=40, micro_batches=2))  # fmt: skip
    a, b = worst_packs(levels, tokens_per_tile=4)
    assert (a.tiles, a.tokens, a.micro_batches) == (16, 160, 4)
    assert (b.tiles, b.tokens, b.micro_batches) == (9, 40, 2)  # 9 x 4 + 2 text tokens <= 40


def _rank(pp, peaks, label="worst level 0"):
    step = {"label": label, "step_ms": 10.0, "forward_ms": [1.0, 1.0], "backward_ms": [2.0, 2.0],
            "call_ms": [1.5, 1.5],
            "static_bytes": 0, "activation_peak_bytes": peaks, "allocator_peak_bytes": None,
            "schedule_ms": 7.0}
    return {"pp": pp, "tp": 0, "dp": 0, "steps": [step, {**step, "label": "typical"}]}


def test_report_fails_exactly_the_stage_over_the_limit_and_names_the_fix() -> None:
    gib = 2**30
    report = build_report(
        ranks=[_rank(0, gib), _rank(1, 3 * gib)], pp=2,
        planned_stages=[{"forward_ms": 1.0, "backward_ms": 2.0, "peak_memory_gib": 1.0}] * 2,
        planned_step_ms=8.0, limits=Limits(capacity_gib=2.5, margin_gib=0.5, time_tolerance=0.1),
        describe_step=lambda label: f"<{label}>", fit_recompute=lambda *_: (0, 2),
        recompute_flags=lambda s, fix: f"<flags {s} {fix}>")  # fmt: skip
    assert not report["ok"] and report["step_ms"] == {"planned": 8.0, "measured": 10.0}
    first, second = report["stages"]
    assert first["verdict"] == {"time": "within tolerance", "memory": "fits", "ok": True}
    assert second["verdict"]["memory"] == "out of memory"
    assert second["fix"] == {"vit_recompute": 0, "llm_recompute": 2, "flags": "<flags 1 (0, 2)>"}
    [failure] = report["failures"]
    assert failure.startswith("stage 1 would run out of memory: peak 3.000 GiB > 2.000 GiB")
    assert "on <worst level 0>" in failure and "<flags 1 (0, 2)>" in failure
    assert report["bubble"]["measured"] == pytest.approx(0.4)  # 10 ms step, 6 ms busy
    assert first["measured"]["outside_schedule_ms"] == pytest.approx(3.0)  # 10 ms step, 7 in it
    assert first["measured"]["outside_forward_ms"] == pytest.approx(0.5)  # 1.5 ms call, 1 fwd


def test_bad_preflight_flags_stop_before_any_training(tmp_path, capsys) -> None:
    from megatron_omnibal.preflight.run import main, training_flags

    assert main(["--omnibal"]) == 2  # no --out
    assert "required: --out" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "r.json"), "--calibrate", "p.json", "--omnibal"]) == 2
    assert "--calibrate re-plans an --omnibal-plan" in capsys.readouterr().err
    assert training_flags(["--save", "d", "--train-iters=9", "--lr", "1"]) == [
        "--lr", "1", "--train-iters", "1000"]  # fmt: skip
    # no --lr: a default one (the learning rate changes no time or memory measured); the
    # schedule's lengths are the long run's, not the preflight's few steps
    assert training_flags(["--lr-warmup-iters", "2000", "--min-lr", "0"]) == [
        "--min-lr", "0", "--train-iters", "1000", "--lr", "1e-05"]  # fmt: skip


def test_a_plan_with_virtual_stages_is_refused_by_name(tmp_path, capsys) -> None:
    from megatron_omnibal.data.lengths import from_arrays
    from megatron_omnibal.models.presets import get_preset
    from megatron_omnibal.planner.cost_model.hardware import get_hardware
    from megatron_omnibal.planner.make import make_plan
    from megatron_omnibal.planner.plan_file.plan import save_plan
    from megatron_omnibal.planner.search.request import PlanRequest
    from megatron_omnibal.preflight.run import main

    lengths = from_arrays([1, 2, 3] * 40, [60, 90, 120] * 40)
    plan = make_plan(PlanRequest(model=get_preset("tiny"), hardware=get_hardware("A100-80G"),
                                 lengths=lengths, gpus=4, tp=1, pp=2, vpp=2, global_batch=64))
    save_plan(plan, tmp_path / "plan.json")
    argv = ["--out", str(tmp_path / "r.json"), "--omnibal", "--omnibal-plan",
            str(tmp_path / "plan.json")]  # fmt: skip
    assert main(argv) == 2
    assert "the plan has vpp 2: the preflight measures 1F1B stages" in capsys.readouterr().err


FLAGS = ["--omnibal", "--omnibal-model", "tiny", "--omnibal-text-scale", "8",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3",
         "--transformer-impl", "local", "--seed", "7", "--log-interval", "1",
         "--hidden-dropout", "0", "--attention-dropout", "0",
         "--worst-steps", "1", "--typical-steps", "1", "--memory-margin-gib", "0"]  # fmt: skip


def _preflight(nproc, out, flags, timeout=300, lr=True):
    """The preflight on `nproc` local ranks (local_ranks, forked from the tests' rank server);
    without `lr`, the training's flags give no --lr."""
    from launch import run_local

    given = FLAGS if lr else [a for a in FLAGS if a not in ("--lr", "1e-3")]
    program = ["-m", "megatron_omnibal.preflight", *given, *flags, "--out", str(out)]
    proc = run_local(nproc, program, timeout, cwd=out.parent)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report


def _plan(path, lengths_file):
    """A real `omnibal plan` plan for tiny at PP=2 with the runs' budgets."""
    from megatron_omnibal.models.presets import get_preset
    from megatron_omnibal.planner.cost_model.hardware import get_hardware
    from megatron_omnibal.planner.make import make_plan
    from megatron_omnibal.planner.plan_file.plan import save_plan
    from megatron_omnibal.planner.search.request import PlanRequest

    plan = make_plan(PlanRequest(model=get_preset("tiny"), hardware=get_hardware("A100-80G"),
                                 lengths=load_lengths(lengths_file), gpus=2, tp=1, pp=2,
                                 micro_batches=2, global_batch=2,
                                 lengths_path=str(lengths_file)))  # fmt: skip
    plan = replace(plan, data=replace(plan.data, vit_budget=16, token_budget=160,
                                      pack_cost=None, levels=()))  # fmt: skip
    save_plan(plan, path)
    return plan


@pytest.mark.megatron
def test_pp2_plan_that_fits_passes_and_a_tight_device_fails_its_heavier_stage(
    lengths_file, tmp_path
):
    plan = _plan(tmp_path / "plan.json", lengths_file)
    # fp32, as the other CPU runs of a plan (a plan alone implies bf16): fp32 memory and times
    flags = ["--omnibal-lengths", str(lengths_file), "--pipeline-model-parallel-size", "2",
             "--omnibal-plan", str(tmp_path / "plan.json"),
             "--omnibal-precision", "fp32"]  # fmt: skip
    profile = tmp_path / "calibrated.json"
    proc, report = _preflight(2, tmp_path / "fit.json", [*flags, "--calibrate", str(profile)],
                              lr=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert proc.stderr.count("preflight: note: no --lr given: measuring with --lr 1e-05") == 1
    assert report["ok"] and report["step_ms"]["planned"] == plan.predicted.step_ms
    _check_calibration(report, profile, plan, lengths_file, tmp_path)
    assert report["limits"]["device_memory_gib"] == plan.hardware_spec.memory_gib  # the plan's
    for st, want in zip(report["stages"], plan.stages, strict=True):
        assert st["planned"] == {"forward_ms": want.forward_ms, "backward_ms": want.backward_ms,
                                 "peak_memory_gib": want.peak_memory_gib}  # fmt: skip
        m = st["measured"]
        assert m["peak_step"] == "worst level 0"  # the largest micro-batches peak the memory
        assert m["peak_memory_gib"] > m["static_gib"] > 0 and m["activation_gib"] > 0
        assert m["forward_ms"] > 0 and m["backward_ms"] > 0 and 0 <= m["bubble"] < 1
        assert m["outside_forward_ms"] > 0  # the data and (last stage) the loss
        assert st["verdict"]["memory"] == "fits"
    assert "preflight: OK" in proc.stdout
    peaks = [st["measured"]["peak_memory_gib"] for st in report["stages"]]
    heavy = max(range(2), key=peaks.__getitem__)
    assert max(peaks) > 1.1 * min(peaks)
    tight = f"{(peaks[0] + peaks[1]) / 2:.6f}"
    proc, report = _preflight(2, tmp_path / "tight.json", [*flags, "--device-memory-gib", tight])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert [st["verdict"]["ok"] for st in report["stages"]] == [s != heavy for s in range(2)]
    assert f"preflight: FAIL: stage {heavy} would run out of memory" in proc.stdout
    assert "the largest micro-batch of packing level 0: 16 image tiles and 160 tokens" in (
        report["failures"][0])


@pytest.mark.megatron
def test_pp3_tight_device_fails_the_middle_stage_and_its_recompute_fits(lengths_file, tmp_path):
    # stage 1 holds three ViT layers, the projector and three LLM layers: the heavy one
    flags = ["--omnibal-lengths", str(lengths_file), "--pipeline-model-parallel-size", "3",
             "--omnibal-vit-pp-layers", "1,3,0", "--omnibal-llm-pp-layers", "0,3,1",
             "--omnibal-vit-budget", "16", "--omnibal-token-budget", "160",
             "--global-batch-size", "3"]  # fmt: skip
    proc, report = _preflight(3, tmp_path / "fit.json", [*flags, "--device-memory-gib", "8"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    peaks = [st["measured"]["peak_memory_gib"] for st in report["stages"]]
    assert peaks[1] > 1.2 * max(peaks[0], peaks[2])
    tight = f"{(peaks[1] + max(peaks[0], peaks[2])) / 2:.6f}"
    proc, report = _preflight(3, tmp_path / "tight.json", [*flags, "--device-memory-gib", tight])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert [st["verdict"]["ok"] for st in report["stages"]] == [True, False, True]
    fix = report["stages"][1]["fix"]
    assert fix is not None and fix["vit_recompute"] + fix["llm_recompute"] > 0
    assert fix["flags"] in report["failures"][0]
    proc, report = _preflight(3, tmp_path / "fixed.json",
                              [*flags, *fix["flags"].split(), "--device-memory-gib", tight])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    assert report["stages"][1]["measured"]["peak_memory_gib"] < float(tight)


def _check_calibration(report, profile, plan, lengths_file, tmp_path):
    """The calibrated profile holds the measured layers, a fitted point-to-point time and
    attention terms, and round-trips through `omnibal plan --profile`: the same plan as the
    preflight's re-plan."""
    from megatron_omnibal.cli import main
    from megatron_omnibal.planner.plan_file.plan import load_plan

    cal = report["calibration"]
    doc = json.loads(profile.read_text())
    # the largest micro-batch: one sample of 160 tokens
    assert doc["measured"] == {"tiles": 16, "tokens": 160, "sumsq": 160**2}
    names = [layer["name"] for layer in doc["layers"]]
    assert names == [*(f"vit.{i}" for i in range(4)), "projector", *(f"llm.{i}" for i in range(4))]
    assert doc["p2p_ms"] >= 0 and doc["step_overhead_ms"] > 0
    for layer in doc["layers"]:
        assert 0 <= layer["attention_ms"] + layer["fixed_ms"] <= layer["forward_ms"] * (1 + 1e-9)
        assert layer["attention_ms"] == 0 or layer["group"] == "llm"  # ViT attends per tile
    by_name = {layer["name"]: layer for layer in doc["layers"]}
    for st, sp in zip(report["stages"], plan.stages, strict=True):
        runs = st["measured"]["runs"]
        assert [r["label"] for r in runs] == ["worst level 0", "spread level 0",
                                              "spread level 0 reversed", "typical"]
        # the spread: one sample each of 1/2 and 2/2 of the largest's 160 tokens, then reversed
        assert [b[1:] for b in runs[1]["batches"]] == [[80, 80**2], [160, 160**2]]
        assert runs[2]["batches"] == runs[1]["batches"][::-1]
        for run in runs:  # per micro-batch, aligned; its layers run inside the stage's forward
            n = len(run["batches"])
            assert n == len(run["call_ms"]) == len(run["forward_ms"]) == len(run["backward_ms"])
            layer_ms = np.sum([run["tower_ms"][t] for t in run["tower_ms"]], axis=0)
            assert np.all(layer_ms <= np.array(run["forward_ms"])) and np.all(layer_ms > 0)
            for tiles, tokens, squares in run["batches"]:
                assert 0 < tiles <= 16 and 0 < tokens <= 160 and tokens <= squares <= tokens**2
        # memory: what each layer stored on the largest micro-batch
        m = st["measured"]
        for tower in ("vit", "llm"):
            first = getattr(sp, f"{tower}_layers")[0]
            for i, (act, _, _) in enumerate(m["layers"].get(tower, [])):
                assert by_name[f"{tower}.{first + i}"]["activation_mib"] >= act * 1024 * (1 - 1e-9)
    replanned = load_plan(cal["plan"])
    assert replanned.predicted.cost_model == "measured profile"
    assert cal["predicted_step_ms"] == {"before": plan.predicted.step_ms,
                                        "after": replanned.predicted.step_ms}  # fmt: skip
    assert cal["changes"][-1].startswith("predicted step ms: ")
    out = tmp_path / "cli_plan.json"
    assert main(["plan", "--profile", str(profile), "--model", "tiny", "--hardware", "A100-80G",
                 "--gpus", "2", "--tp", "1", "--pp", "2", "--micro-batches", "2",
                 "--global-batch", "2", "--lengths", str(lengths_file), "--seed",
                 str(plan.data.seed), "--out", str(out)]) == 0  # fmt: skip
    cli = load_plan(out)
    assert cli.stages == replanned.stages and cli.data == replanned.data
    assert cli.predicted.step_ms == replanned.predicted.step_ms


def test_a_profiles_step_overhead_adds_to_every_predicted_step() -> None:
    """A calibrated profile's per-step overhead (optimizer, per-step work) is paid once per
    step, by the plan and by the baseline it is compared with."""
    from megatron_omnibal.data.lengths import from_arrays
    from megatron_omnibal.models.presets import get_preset
    from megatron_omnibal.planner.cost_model.hardware import get_hardware
    from megatron_omnibal.planner.make import make_plan
    from megatron_omnibal.planner.search.request import PlanRequest

    def layer(name, ms, group):
        return {"name": name, "forward_ms": ms, "backward_ms": 2 * ms, "activation_mib": 1.0,
                "weight_mib": 1.0, "checkpoint_mib": 0.1, "output_mib": 0.1, "group": group}

    layers = [*(layer(f"vit.{i}", 1.0, "vit") for i in range(4)), layer("projector", 0.2, "none"),
              *(layer(f"llm.{i}", 2.0, "llm") for i in range(4))]  # fmt: skip
    doc = {"micro_batches": 4, "layers": layers, "measured": {"tiles": 8, "tokens": 128}}
    vit = [1, 2, 3, 1] * 16
    stats = from_arrays(vit, [v * 4 + 30 for v in vit])

    def plan(profile):
        return make_plan(PlanRequest(model=get_preset("tiny"), hardware=get_hardware("H100-80G"),
                                     lengths=stats, gpus=2, pp=2, global_batch=32,
                                     profile=profile))  # fmt: skip

    a, b = plan(doc), plan({**doc, "step_overhead_ms": 7.5})
    assert b.stages == a.stages
    assert b.predicted.step_ms == pytest.approx(a.predicted.step_ms + 7.5, abs=1e-3)
    assert b.predicted.sync_ms == pytest.approx(a.predicted.sync_ms + 7.5, abs=1e-3)
    assert b.predicted.baseline.step_ms == pytest.approx(a.predicted.baseline.step_ms + 7.5,
                                                         abs=1e-3)  # fmt: skip
