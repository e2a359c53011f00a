"""The preflight run: the training entry point with a measured forward step, a stream of the
largest then typical micro-batches, and a report gathered from every rank.

Why through megatron/pretrain_vlm.main: the stages, the recompute, the schedule, the optimizer and
the checkpoint loading (--pretrained-checkpoint) are the training's own, so what is measured is
what the long run will do. Megatron's train loop runs as many iterations as the stream holds.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from megatron_omnibal.megatron.flags.optimizer_args import PREFLIGHT_LR
from megatron_omnibal.preflight.measure import StepMeter
from megatron_omnibal.preflight.options import PreflightOptions, parse, without_long_run_flags
from megatron_omnibal.preflight.packs import WorstPack, spread_packs, worst_lengths, worst_packs
from megatron_omnibal.preflight.report import (
    SPREAD,
    TYPICAL,
    WARM_UP,
    WORST,
    Limits,
    build_report,
    table,
)


def training_flags(rest: Sequence[str]) -> list[str]:
    """The training's flags without those a preflight replaces, with a placeholder length (the
    stream sets the real one once it knows the packing levels) and a learning rate when none
    is given (a preflight measures time and memory, which it does not change)."""
    flags = [*without_long_run_flags(rest), "--train-iters", "1000"]
    if not has_lr(flags):
        flags += ["--lr", str(PREFLIGHT_LR)]
    return flags


def has_lr(flags: Sequence[str]) -> bool:
    return any(a.split("=")[0] == "--lr" for a in flags)


class PreflightStream:
    """Megatron's training iterator: one warm-up step of the balanced stream, the largest
    micro-batches of each level (with `--calibrate` a spread of sizes up to them), then typical
    steps of the balanced stream."""

    def __init__(self, labels: list[str], fixed: dict[str, tuple[list[Any], int]], typical: Any,
                 meter: StepMeter) -> None:  # fmt: skip
        self.meter = meter  # hears of every micro-batch's size, for the calibration
        self.labels = labels
        self.fixed = fixed  # label -> (its micro-batches in order, cycled; micro-batches per step)
        self.typical = typical
        self.step = -1
        self.left = 0
        self.index = 0  # of the next micro-batch in its step

    def micro_batches_of_next_step(self) -> int:
        label = self.labels[self.step + 1]
        if label in self.fixed:
            return self.fixed[label][1]
        return self.typical.micro_batches_of_next_step()

    def __iter__(self) -> PreflightStream:
        return self

    def __next__(self) -> Any:
        if self.left == 0:
            self.left = self.micro_batches_of_next_step()
            self.step += 1
            self.index = 0
        self.left -= 1
        label = self.labels[self.step]
        if label in self.fixed:
            batches = self.fixed[label][0]
            batch = batches[self.index % len(batches)]
        else:
            batch = next(self.typical)
        self.index += 1
        if self.meter.steps:
            cu = batch.cu_seqlens.tolist()
            self.meter.current.batches.append(self.meter.batch_features(
                len(batch.image_flags), [b - a for a, b in itertools.pairwise(cu)]))  # fmt: skip
        return batch


# the spread's two steps: sizes rising, then falling, so that a load that changes while they
# run (a shared machine's) does not grow or shrink with the size and bend the fit
SPREAD_ORDERS = ("", " reversed")


def step_labels(packs: Sequence[WorstPack], opts: PreflightOptions) -> list[str]:
    worst = [f"{WORST} level {p.level}" for p in packs for _ in range(opts.worst_steps)]
    spread = [f"{SPREAD} level {p.level}{order}" for p in packs for order in SPREAD_ORDERS]
    spread = spread if opts.calibrate is not None else []
    return [WARM_UP, *worst, *spread, *([TYPICAL] * opts.typical_steps)]


def build_stream(meter: StepMeter, opts: PreflightOptions, settings: Any, spec: Any,
                 *_: Any) -> tuple[PreflightStream, None, None]:  # fmt: skip
    """build_iterators for pretrain_vlm.main: the preflight's stream on this rank."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    from megatron_omnibal.megatron.stream.batch import collate, synthetic_sample
    from megatron_omnibal.megatron.training.pretrain_vlm import build_data_iterators

    args = get_args()
    typical, _, _ = build_data_iterators(settings, spec)
    packs = worst_packs(settings.balance.all_levels, spec.tokens_per_tile)
    pixels = settings.layouts[parallel_state.get_pipeline_model_parallel_rank()].patch_embed

    def batches(of: tuple[WorstPack, ...]) -> list[Any]:
        lengths, out = worst_lengths(of), []
        for i, p in enumerate(of):
            out.append(collate([synthetic_sample(i, lengths, spec, seed=args.seed,
                                                 pixels=pixels)]))  # fmt: skip
            out[-1].level = p.level
        return out

    fixed = {}
    for p in packs:
        fixed[f"{WORST} level {p.level}"] = (batches((p,)), p.micro_batches)
        rising = batches(spread_packs(p, spec.tokens_per_tile))
        for order, sizes in zip(SPREAD_ORDERS, (rising, rising[::-1]), strict=True):
            fixed[f"{SPREAD} level {p.level}{order}"] = (sizes, p.micro_batches)
    meter.labels = step_labels(packs, opts)
    # Megatron's loop reads it every iteration; a run resumed with --load counts on from there
    args.train_iters = args.iteration + len(meter.labels)
    return PreflightStream(meter.labels, fixed, typical, meter), None, None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the training entry point measured, report. Exit status: 0 when every stage
    fits, 1 when one would run out of memory, 2 on bad flags."""
    import torch

    from megatron_omnibal.megatron.training import pretrain_vlm

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from megatron_omnibal.preflight.options import parser

        parser().print_help()
        return 0
    try:
        opts, rest = parse(argv)
    except SystemExit as exc:  # argparse printed the usage and the error
        return int(exc.code or 0)
    except ValueError as exc:
        print(f"preflight: {exc}", file=sys.stderr)
        return 2
    if opts.calibrate is not None and not any(a.split("=")[0] == "--omnibal-plan" for a in rest):
        print("preflight: --calibrate re-plans an --omnibal-plan: give the plan", file=sys.stderr)
        return 2
    chunks = _plan_vpp(rest)
    if chunks > 1:
        print(f"preflight: the plan has vpp {chunks}: the preflight measures 1F1B stages (one "
              "model chunk per rank) only", file=sys.stderr)  # fmt: skip
        return 2
    from megatron_omnibal.megatron.runtime.compat import ensure_typing_override
    from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron

    cpu = enable_cpu_megatron()  # as the entry point does, before Megatron is imported
    ensure_typing_override()
    gpu = torch.cuda.is_available() and not cpu
    meter = StepMeter([], gpu)
    meter.install()
    captured: dict[str, Any] = {}

    def stream(settings: Any, spec: Any, *args: Any) -> Any:
        captured.update(settings=settings, spec=spec)
        return build_stream(meter, opts, settings, spec, *args)

    if not has_lr(rest) and int(os.environ.get("RANK", "0")) == 0:
        print(f"preflight: note: no --lr given: measuring with --lr {PREFLIGHT_LR} (a learning "
              "rate changes no time or memory measured)", file=sys.stderr)
    status = pretrain_vlm.main(training_flags(rest), build_iterators=stream)
    if status != 0:
        return status
    report = gather_report(meter, opts, captured["settings"], captured["spec"], gpu)
    return 0 if report["ok"] else 1


def _plan_vpp(argv: Sequence[str]) -> int:
    """The model chunks per rank of the --omnibal-plan in `argv` (1 without a plan; a bad plan
    is the entry point's to report)."""
    from megatron_omnibal.planner.plan_file.plan import PlanError, load_plan

    paths = [b for a, b in zip(argv, argv[1:], strict=False) if a == "--omnibal-plan"]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--omnibal-plan=")]
    try:
        return load_plan(paths[-1]).parallel.vpp if paths else 1
    except (PlanError, OSError, ValueError):
        return 1


def gather_report(meter: StepMeter, opts: PreflightOptions, settings: Any, spec: Any,
                  gpu: bool) -> dict[str, Any]:  # fmt: skip
    """Every rank's step records to every rank; rank 0 prints the table and writes the JSON."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_omnibal.preflight.recompute_fit import LayerMeasure, fitting_recompute

    mine = {"pp": ps.get_pipeline_model_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "steps": [asdict(s) for s in meter.steps]}
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    plan = settings.plan
    hardware = plan.hardware_spec if plan is not None else None
    capacity = opts.device_memory_gib
    if capacity is None and gpu:
        capacity = torch.cuda.get_device_properties(0).total_memory / 2**30
    elif capacity is None and hardware is not None:
        capacity = hardware.memory_gib
    margin = opts.memory_margin_gib
    if margin is None:
        margin = hardware.reserve_gib if hardware is not None else 4.0
    packs = {f"{WORST} level {p.level}": p
             for p in worst_packs(settings.balance.all_levels, spec.tokens_per_tile)}  # fmt: skip

    def describe(label: str) -> str:
        if label in packs:
            return packs[label].describe()
        return f"a {label} step of the balanced stream"

    def fit(stage: int, measured: dict, limit: float) -> Any:
        p = packs.get(measured["peak_step"]) or next(iter(packs.values()))
        st = settings.layouts[stage]
        vit_now, llm_now = st.vit_recompute, st.llm_recompute
        if settings.level_recompute:
            vit_now, llm_now = settings.level_recompute[stage][p.level]

        def rows(tower: str) -> list[LayerMeasure]:
            return [LayerMeasure(activation_gib=a, input_gib=i, forward_ms=ms)
                    for a, i, ms in measured["layers"].get(tower, [])]  # fmt: skip

        return fitting_recompute(
            static_gib=measured["static_gib"], activation_gib=measured["activation_gib"],
            inflight=min(settings.pp_size - stage, p.micro_batches), vit=rows("vit"),
            llm=rows("llm"), vit_now=vit_now, llm_now=llm_now, limit_gib=limit)  # fmt: skip

    def flags(stage: int, fix: tuple[int, int]) -> str:
        vit = [st.vit_recompute for st in settings.layouts]
        llm = [st.llm_recompute for st in settings.layouts]
        vit[stage], llm[stage] = fix
        return (f"--omnibal-vit-recompute {','.join(map(str, vit))} "
                f"--omnibal-llm-recompute {','.join(map(str, llm))}")  # fmt: skip

    planned = None
    if plan is not None:
        planned = [{"forward_ms": st.forward_ms, "backward_ms": st.backward_ms,
                    "peak_memory_gib": st.peak_memory_gib} for st in plan.stages]  # fmt: skip
    report = build_report(
        ranks=ranks, pp=settings.pp_size, planned_stages=planned,
        planned_step_ms=plan.predicted.step_ms if plan is not None else None,
        limits=Limits(capacity_gib=capacity, margin_gib=margin,
                      time_tolerance=opts.time_tolerance),
        describe_step=describe, fit_recompute=fit, recompute_flags=flags,
    )  # fmt: skip
    report["memory_source"] = "allocator peak" if gpu else "tracked tensor bytes (CPU)"
    if dist.get_rank() == 0:
        if opts.calibrate is not None:
            report["calibration"] = calibrate(report, opts, settings, spec, packs, limit=(
                report["limits"]["memory_limit_gib"]))  # fmt: skip
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(report, indent=1) + "\n")
        print("\n".join(table(report)), flush=True)
        for line in report.get("calibration", {}).get("changes", []):
            print(f"preflight: calibrated plan: {line}", flush=True)
    return report


def calibrate(report: dict[str, Any], opts: PreflightOptions, settings: Any, spec: Any,
              packs: dict[str, WorstPack], limit: float | None) -> dict[str, Any]:  # fmt: skip
    """Write the calibrated profile and the plan made from it; what changed, for the report."""
    from megatron_omnibal.preflight.calibrate import calibrated_profile, plan_changes, replan

    labels = {st["measured"]["peak_step"] for st in report["stages"]}
    if len(labels) != 1 or next(iter(labels)) not in packs:
        raise ValueError(f"--calibrate: the stages peaked on different steps {sorted(labels)}; "
                         "calibrate with one packing level")  # fmt: skip
    pack = packs[next(iter(labels))]
    profile = calibrated_profile(
        report=report, spec=spec, layouts=[st.to_dict() for st in settings.layouts],
        tiles=pack.tiles, tokens=pack.tokens, micro_batches=settings.micro_batches,
        memory_budget_gib=limit)  # fmt: skip
    opts.calibrate.parent.mkdir(parents=True, exist_ok=True)
    opts.calibrate.write_text(json.dumps(profile, indent=1) + "\n")
    out = opts.calibrate.with_name(f"{opts.calibrate.stem}.plan.json")
    new = replan(settings.plan, profile, opts.calibrate, out)
    before, after = settings.plan.to_dict(), new.to_dict()
    return {"profile": str(opts.calibrate), "plan": str(out),
            "predicted_step_ms": {"before": before["predicted"]["step_ms"],
                                  "after": after["predicted"]["step_ms"]},
            "measured_step_ms": report["step_ms"]["measured"],
            "changes": plan_changes(before, after)}  # fmt: skip


