"""The preflight's own flags; every other flag is the training's and goes to its entry point."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from megatron_omnibal.cli_args import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

# flags of a long run that a preflight must not act on (it saves nothing, sets its own length
# and follows no learning-rate schedule: a warm-up longer than its few steps is no error)
_DROPPED = ("--save", "--save-interval", "--exit-interval", "--train-iters",
            "--exit-duration-in-mins", "--lr-warmup-iters", "--lr-decay-iters",
            "--lr-wsd-decay-iters")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class PreflightOptions:
    out: Path
    device_memory_gib: float | None  # None: the GPU's, else the plan's hardware, else unknown
    memory_margin_gib: float | None  # None: the plan's hardware reserve, else 4 GiB on a GPU
    time_tolerance: float
    worst_steps: int  # per packing level
    typical_steps: int
    calibrate: Path | None

    def __post_init__(self) -> None:
        if self.worst_steps + self.typical_steps < 1:
            raise ValueError("--worst-steps and --typical-steps: at least one step to measure")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_omnibal.preflight",
        description="Run the plan's stages for a few steps on the largest and on typical "
        "micro-batches, compare memory and time with the plan, and exit 1 when a stage would run "
        "out of memory. Every flag not listed here is the training's (Megatron and --omnibal*).",
        add_help=False,
    )
    p.add_argument("--out", type=Path, required=True, help="the JSON report")
    p.add_argument("--device-memory-gib", type=positive_float, default=None,
                   help="device memory to check against (default: the GPU's; on a CPU the "
                   "plan's hardware, else no memory verdict); set it lower to check for a "
                   "smaller device")  # fmt: skip
    p.add_argument("--memory-margin-gib", type=non_negative_float, default=None,
                   help="memory kept free of the device memory (CUDA context, NCCL buffers, "
                   "fragmentation; default: the plan's hardware reserve, else 4)")  # fmt: skip
    p.add_argument("--time-tolerance", type=positive_float, default=0.25,
                   help="relative difference of measured and planned time per micro-batch "
                   "still within the plan (default 0.25)")  # fmt: skip
    p.add_argument("--worst-steps", type=non_negative_int, default=1,
                   help="steps of the largest micro-batches per packing level (default 1)")
    p.add_argument("--typical-steps", type=positive_int, default=3,
                   help="steps of the balanced stream after one warm-up step (default 3)")
    p.add_argument("--calibrate", type=Path, default=None, metavar="PROFILE.json",
                   help="also write a layer profile fitted to the measurement and re-plan "
                   "with it")  # fmt: skip
    return p


def config_options() -> dict[str, Callable[[str], object]]:
    """The options a fine-tuning config may set under `preflight` (by their flags' names with `_`
    for `-`), each with the check of its flag; where the report and the profile go is the
    workflow's."""
    return {a.dest: a.type for a in parser()._actions
            if a.dest not in ("out", "calibrate") and a.type is not None}  # fmt: skip


def parse(argv: Sequence[str]) -> tuple[PreflightOptions, list[str]]:
    """(the preflight's options, the training's flags)."""
    ns, rest = parser().parse_known_args(list(argv))
    return PreflightOptions(**vars(ns)), rest


def without_long_run_flags(flags: Sequence[str], dropped: Sequence[str] = _DROPPED) -> list[str]:
    """`flags` without those named in `dropped` (each with its value)."""
    out, skip = [], False
    for arg in flags:
        if skip:
            skip = False
            continue
        name = arg.split("=")[0]
        if name in dropped:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out
