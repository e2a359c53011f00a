"""A GPU's peak matrix rate for MFU: the hardware presets' dense BF16 figures, found by the
device name torch reports, or the user's own figure.

Why only BF16/FP16: the presets hold the data sheets' dense 16-bit tensor-core peaks, which is
what mixed-precision training runs at; an FP32 run's peak depends on whether TF32 is allowed, and
variants that share a name with a preset but not its clocks (H100 PCIe, H100 NVL) are not
guessed. For those, `--omnibal-peak-tflops` gives the figure, or MFU is not reported.
"""

from __future__ import annotations

from megatron_omnibal.planner.cost_model.hardware import HARDWARE

HALF_PRECISIONS = ("bf16", "fp16")
# (substring of torch.cuda.get_device_name(), substrings that rule it out, preset)
_NAMES = (
    ("H200", (), "H200"),
    ("H100", ("PCIe", "NVL"), "H100-80G"),
    ("A100", (), "A100-80G"),
)


def device_peak_tflops(
    device_name: str | None, precision: str, override: float | None = None
) -> tuple[float | None, str]:
    """(peak dense TFLOP/s of one GPU or None, where the figure comes from / why none)."""
    if override is not None:
        if override <= 0:
            raise ValueError(f"--omnibal-peak-tflops must be positive, got {override}")
        return float(override), "--omnibal-peak-tflops"
    if device_name is None:
        return None, "no GPU (give --omnibal-peak-tflops for MFU)"
    if precision not in HALF_PRECISIONS:
        return None, f"{precision} run on {device_name}: give --omnibal-peak-tflops for MFU"
    for part, unless, preset in _NAMES:
        if part in device_name and not any(u in device_name for u in unless):
            hw = HARDWARE[preset]
            return hw.peak_tflops, f"{device_name}: {hw.name} preset, dense {precision.upper()}"
    return None, f"{device_name} is not a known GPU: give --omnibal-peak-tflops for MFU"
