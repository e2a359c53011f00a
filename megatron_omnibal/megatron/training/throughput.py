"""Model TFLOP/s per GPU and MFU of training steps, from the samples each step really trained.

Why: throughput in tokens/s cannot be compared across models or clusters; model-FLOPs
utilisation can. The FLOPs of a step come from the balanced stream's per-step figures (tiles,
tokens and the sum of squared sample lengths of every DP rank: stream_steps), counted by the
planner's formula (planner.flops), so padding and recomputation never count as useful work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_omnibal.megatron.stream.stream_steps import StepFigures
from megatron_omnibal.planner.cost_model.flops import ModelFlops


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """How to turn a step's figures and time into TFLOP/s per GPU and MFU."""

    flops: ModelFlops
    gpus: int  # every GPU of the run (TP x PP x DP)
    peak_tflops: float | None  # None: MFU not reported
    peak_source: str  # where the peak comes from, or why there is none

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError(f"Throughput.gpus must be >= 1, got {self.gpus}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"Throughput.peak_tflops must be > 0, got {self.peak_tflops}")

    def step_flops(self, figures: StepFigures) -> float:
        """Useful training FLOPs of one step over all DP ranks."""
        return float(self.flops.training(figures.tiles, figures.tokens, figures.sumsq).sum())

    def rates(self, figures: Sequence[StepFigures], seconds: float) -> tuple[float, float | None]:
        """(model TFLOP/s per GPU, MFU as a fraction or None) of steps taking `seconds`."""
        if seconds <= 0:
            raise ValueError(f"Throughput.rates needs positive seconds, got {seconds}")
        tflops = sum(self.step_flops(f) for f in figures) / seconds / self.gpus / 1e12
        return tflops, None if self.peak_tflops is None else tflops / self.peak_tflops

    def describe(self, figures: Sequence[StepFigures], seconds: float) -> str:
        """'model TFLOP/s/GPU x | MFU y%' of steps taking `seconds` (MFU n/a without a peak):
        the one wording of the iteration line and the first-step line."""
        tflops, fraction = self.rates(figures, seconds)
        share = "n/a" if fraction is None else f"{100 * fraction:.1f}%"
        return f"model TFLOP/s/GPU {tflops:.3f} | MFU {share}"


def device_name() -> str | None:
    """The GPU's name as torch reports it; None on a CPU run (also under the CPU shim)."""
    import torch

    from megatron_omnibal.megatron.runtime.cpu import cpu_megatron_enabled

    if cpu_megatron_enabled() or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name()


def run_throughput(
    spec: Any, gpus: int, precision: str, peak_tflops: float | None, device_name: str | None
) -> Throughput:
    """The run's Throughput: its model, its GPU count, the device's peak at its precision
    (`peak_tflops`: --omnibal-peak-tflops, else the device's known peak)."""
    from megatron_omnibal.planner.cost_model.device_peak import device_peak_tflops

    peak, source = device_peak_tflops(device_name, precision, peak_tflops)
    return Throughput(flops=ModelFlops.of(spec), gpus=gpus, peak_tflops=peak, peak_source=source)
