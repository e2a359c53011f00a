"""A preflight's report: per stage, planned against measured, a verdict, and what to change.

Pure: the per-rank step records (measure.StepRecord as dicts, with the rank's pipeline stage)
in, the JSON report and its table out. Times are per micro-batch means over the typical steps
(the plan predicts its mean balanced micro-batch); memory is the peak over every step, the
largest micro-batches included (the plan predicts its largest).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import mean, median
from typing import Any

GIB = 2.0**30
WORST = "worst"  # step labels: "worst level L", "spread level L", "typical", "warm-up"
SPREAD = "spread"
TYPICAL = "typical"
WARM_UP = "warm-up"


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What a stage must stay within: device memory less a margin; time within a tolerance."""

    capacity_gib: float | None  # None: unknown (no verdict on memory)
    margin_gib: float
    time_tolerance: float  # relative, e.g. 0.25

    def __post_init__(self) -> None:
        if self.capacity_gib is not None and self.capacity_gib <= 0:
            raise ValueError(f"device memory must be positive, got {self.capacity_gib} GiB")
        if self.margin_gib < 0 or self.time_tolerance <= 0:
            raise ValueError(f"margin ({self.margin_gib} GiB) must be >= 0 and time tolerance "
                             f"({self.time_tolerance}) > 0")  # fmt: skip

    @property
    def memory_limit_gib(self) -> float | None:
        return None if self.capacity_gib is None else self.capacity_gib - self.margin_gib


# (stage, its measured figures, limit GiB) -> fitting (ViT, LLM) recompute or None
FitRecompute = Callable[[int, dict, float], "tuple[int, int] | None"]


def _steps(ranks: Sequence[dict], stage: int) -> list[list[dict]]:
    """Step k's records of every rank of `stage` (TP and DP ranks alike)."""
    mine = [r["steps"] for r in ranks if r["pp"] == stage]
    return [list(step) for step in zip(*mine, strict=True)]


def _peak(rec: dict) -> int:
    if rec.get("allocator_peak_bytes") is not None:
        return rec["allocator_peak_bytes"]
    return rec["static_bytes"] + rec["activation_peak_bytes"]


def measure_stage(steps: list[list[dict]]) -> dict[str, Any]:
    """Measured figures of one stage from its step records."""
    typical = [s for s in steps if s[0]["label"] == TYPICAL] or steps
    worst = [s for s in steps if s[0]["label"].startswith(WORST)]
    peak_rec, peak_label = max(((r, s[0]["label"]) for s in steps for r in s),
                               key=lambda x: _peak(x[0]))  # fmt: skip

    def per_micro(group: list[list[dict]], key: str) -> float | None:
        values = [ms for s in group for r in s for ms in r[key]]
        return mean(values) if values else None

    step_ms = [max(r["step_ms"] for r in s) for s in typical]
    busy = [mean(sum(r["forward_ms"]) + sum(r["backward_ms"]) for r in s) for s in typical]
    idle = [max(t - b, 0.0) for t, b in zip(step_ms, busy, strict=True)]
    return {
        "peak_memory_gib": _peak(peak_rec) / GIB,
        "static_gib": peak_rec["static_bytes"] / GIB,
        # the static state by part ("weights", "gradients", "optimizer")
        "static_parts_gib": {k: b / GIB for k, b in peak_rec.get("static_part_bytes", {}).items()},
        "activation_gib": peak_rec["activation_peak_bytes"] / GIB,
        "peak_step": peak_label,
        "allocator": peak_rec.get("allocator_peak_bytes") is not None,
        # per tower, per layer on the peak step: [activation GiB, input GiB, forward ms]
        "layers": {tower: [[a / GIB, i / GIB, ms] for a, i, ms in rows]
                   for tower, rows in peak_rec.get("layers", {}).items()},  # fmt: skip
        # every measured step (the warm-up aside) per micro-batch, on the stage's first rank:
        # what --calibrate fits the layer times and the point-to-point time to
        "runs": [_run(s[0]) for s in steps if s[0]["label"] != WARM_UP],
        # per micro-batch, the forward step's time outside the stage's forward (data, the
        # batch's checks and copy, the loss): on the pipeline's path, in no layer
        "outside_forward_ms": _difference(per_micro(typical, "call_ms"),
                                          per_micro(typical, "forward_ms")),  # fmt: skip
        "forward_ms": per_micro(typical, "forward_ms"),
        "backward_ms": per_micro(typical, "backward_ms"),
        "worst_forward_ms": per_micro(worst, "forward_ms"),
        "worst_backward_ms": per_micro(worst, "backward_ms"),
        "step_ms": median(step_ms),
        # the step's time outside this stage's pipeline schedule (data, optimizer, per-step
        # work): on the first stage, whose schedule spans the whole pipeline, the step's
        # overhead beyond the pipeline
        "outside_schedule_ms": median(max(r["step_ms"] - r["schedule_ms"], 0.0)
                                      for s in typical for r in s),
        "idle_ms": mean(idle),
        "bubble": mean(i / t for i, t in zip(idle, step_ms, strict=True) if t > 0),
    }


def _difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else max(a - b, 0.0)


def _run(rec: dict) -> dict[str, Any]:
    """One step's figures per micro-batch: [tiles, tokens, squared lengths attended] of each,
    its forward step (`call_ms`: data, checks, forward, loss), stage forward and backward ms,
    each tower's layers' forward ms; and the step's schedule span."""
    return {key: rec.get(key) for key in ("label", "step_ms", "schedule_ms", "batches",
                                          "call_ms", "forward_ms", "backward_ms", "tower_ms")}


def _time_verdict(planned: dict | None, measured: dict, tolerance: float) -> str:
    if planned is None or measured["forward_ms"] is None:
        return "no plan"
    want = planned["forward_ms"] + planned["backward_ms"]
    got = measured["forward_ms"] + measured["backward_ms"]
    if want <= 0:
        return "no plan"
    error = got / want - 1.0
    if abs(error) <= tolerance:
        return "within tolerance"
    return f"{'slower' if error > 0 else 'faster'} than planned by {100 * abs(error):.0f}%"


def build_report(
    *,
    ranks: Sequence[dict],
    pp: int,
    planned_stages: Sequence[dict] | None,
    planned_step_ms: float | None,
    limits: Limits,
    describe_step: Callable[[str], str],
    fit_recompute: FitRecompute,
    recompute_flags: Callable[[int, tuple[int, int]], str],
) -> dict[str, Any]:
    """The report (see the module doc); `describe_step(label)` names a step's micro-batches,
    `recompute_flags(stage, (vit, llm))` the flags that set a stage's recompute."""
    limit = limits.memory_limit_gib
    stages, failures = [], []
    for s in range(pp):
        measured = measure_stage(_steps(ranks, s))
        planned = planned_stages[s] if planned_stages else None
        verdict: dict[str, Any] = {"time": _time_verdict(planned, measured, limits.time_tolerance)}
        entry: dict[str, Any] = {"stage": s, "planned": planned, "measured": measured}
        if limit is None:
            verdict["memory"] = "unknown device memory"
            verdict["ok"] = True
        elif measured["peak_memory_gib"] <= limit:
            verdict["memory"] = "fits"
            verdict["ok"] = True
        else:
            verdict["memory"] = "out of memory"
            verdict["ok"] = False
            fix = fit_recompute(s, measured, limit)
            entry["fix"] = None if fix is None else {
                "vit_recompute": fix[0], "llm_recompute": fix[1],
                "flags": recompute_flags(s, fix)}  # fmt: skip
            remedy = (f"recompute that would fit: {recompute_flags(s, fix)} (stage {s}: "
                      f"{fix[0]} ViT and {fix[1]} LLM layers)") if fix else (
                "no recompute of this stage fits: lower the budgets or re-plan for this "
                "device memory")  # fmt: skip
            failures.append(
                f"stage {s} would run out of memory: peak {measured['peak_memory_gib']:.3f} GiB "
                f"> {limit:.3f} GiB (device {limits.capacity_gib:.3f} GiB less a "
                f"{limits.margin_gib:.3f} GiB margin) on {describe_step(measured['peak_step'])}; "
                f"{remedy}")  # fmt: skip
        entry["verdict"] = verdict
        stages.append(entry)
    measured_step = max(st["measured"]["step_ms"] for st in stages)
    return {
        "ok": not failures,
        "step_ms": {"planned": planned_step_ms, "measured": measured_step},
        "bubble": {"measured": max(st["measured"]["bubble"] for st in stages)},
        "limits": {"device_memory_gib": limits.capacity_gib, "margin_gib": limits.margin_gib,
                   "memory_limit_gib": limit, "time_tolerance": limits.time_tolerance},
        "stages": stages,
        "failures": failures,
    }  # fmt: skip


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(report: dict[str, Any]) -> list[str]:
    """The report as text lines: one row per stage, planned / measured, and the verdicts."""
    rows = [
        "preflight: stage | peak memory GiB planned / measured | forward ms planned / measured | "
        "backward ms planned / measured | idle ms | verdict",
    ]
    for st in report["stages"]:
        p, m, v = st["planned"] or {}, st["measured"], st["verdict"]
        rows.append(
            f"preflight: {st['stage']:5d} | {_fmt(p.get('peak_memory_gib'), '.3f')} / "
            f"{m['peak_memory_gib']:.3f} ({m['peak_step']}) | {_fmt(p.get('forward_ms'), '.2f')}"
            f" / {_fmt(m['forward_ms'], '.2f')} | {_fmt(p.get('backward_ms'), '.2f')} / "
            f"{_fmt(m['backward_ms'], '.2f')} | {m['idle_ms']:.2f} | memory {v['memory']}, "
            f"time {v['time']}")  # fmt: skip
    step, limit = report["step_ms"], report["limits"]["memory_limit_gib"]
    rows.append(f"preflight: step ms planned {_fmt(step['planned'], '.2f')}, measured "
                f"{step['measured']:.2f}; bubble measured {report['bubble']['measured']:.3f}; "
                f"memory limit {_fmt(limit, '.3f')} GiB")  # fmt: skip
    rows += [f"preflight: FAIL: {f}" for f in report["failures"]]
    rows.append(f"preflight: {'OK' if report['ok'] else 'FAILED'}")
    return rows
