"""Calibrated step-time predictions against real Megatron runs on this CPU.

For each (model shape, pipeline size): a plan; then, in every round, the preflight of that plan
with `--calibrate` (its largest micro-batches, the spread of sizes up to them, and a few typical
steps, drawn with one seed) and
right after it a real training run of the plan's layout on other steps (another seed):
balanced micro-batches (`--omnibal-plan`) or the usual fixed-size micro-batches padded to their
longest sample (`baseline`). The round's prediction is the planner's pipeline simulator with
that round's calibrated profile (`omnibal plan --profile` reads the same file) on exactly the
micro-batches each timed step trained on; the calibration never saw those steps. Calibrating
next to the run it predicts keeps a shared machine's changing load out of the comparison as
far as it can be.

Each layout is run `--repeats` times, the layouts interleaved (one round runs every layout
once), each run its own torchrun under this process; a run's step time is the median of its
timed steps (the wall time of Megatron's `train_step` on the first stage, what the preflight
times and the calibration predicts), the layout's the median over
the repeats, its prediction the median of the rounds' predictions; its noise the spread of the
repeats ((max - min) / median) and of the rounds' predictions, printed beside the error
(median predicted / median measured - 1).

Layouts (4): 6+20b PP=2 balanced, 6+20b PP=3 baseline, llava-7b PP=2 baseline, llava-7b PP=3
balanced (shapes: bench_megatron.py). PP=3 runs three ranks on the cores there are.

Usage: python bench/bench_preflight.py [--repeats 3] [--steps 5] [--warmup 1]
       [--layouts 6+20b:2:balanced,...] [--work-dir DIR] [--json PATH] [--refit]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_megatron as bm  # noqa: E402  (shapes, lengths, the timed torchrun worker)

LAYOUTS = ("6+20b:2:balanced", "6+20b:3:baseline", "llava-7b:2:baseline", "llava-7b:3:balanced")
CALIBRATION_SEED = 11  # the preflight's steps; the timed runs use bench_megatron's seed (3)


def flags_for(pp: int, lengths: Path, micro: int, steps: int) -> list[str]:
    flags = bm.common_flags(lengths, micro, steps)
    flags[flags.index("--pipeline-model-parallel-size") + 1] = str(pp)
    return flags


def torchrun(pp: int, argv: list[str]) -> None:
    bm.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={pp}", *argv], timeout=1800)  # fmt: skip


def prepare(shape: str, pp: int, args: argparse.Namespace, tmp: Path) -> dict:
    """Lengths, a plan at `pp`, and the flags of its preflight and runs."""
    from megatron_omnibal.data.lengths import load_lengths, save_lengths
    from megatron_omnibal.megatron.stream.data import model_lengths
    from megatron_omnibal.models.spec import ModelSpec
    from megatron_omnibal.planner.make import make_plan
    from megatron_omnibal.planner.plan_file.plan import save_plan
    from megatron_omnibal.planner.search.request import PlanRequest

    tmp.mkdir(parents=True, exist_ok=True)
    spec = ModelSpec.from_dict(bm.SHAPES[shape])
    model_file = tmp / "model.json"
    model_file.write_text(json.dumps(bm.SHAPES[shape]))
    real = load_lengths(bm.EXAMPLE)
    pick = np.sort(np.random.default_rng(0).choice(len(real), args.samples, replace=False))
    lengths = model_lengths(real.subset(pick), bm.DATA_TOKENS_PER_TILE, spec.tokens_per_tile,
                            bm.TEXT_SCALE)  # fmt: skip
    lengths_file = tmp / "lengths.npz"
    save_lengths(lengths, lengths_file)
    m = args.micro_batches
    request = PlanRequest(model=spec, hardware=bm.cpu_hardware(1e9), lengths=lengths,
                          lengths_path=str(lengths_file), gpus=pp, tp=1, pp=pp, micro_batches=m,
                          global_batch=m * args.samples_per_micro_batch,
                          plan_path=str(tmp / "plan.json"))  # fmt: skip
    plan = make_plan(request)
    save_plan(plan, tmp / "plan.json")
    base = [*flags_for(pp, lengths_file, m, args.steps), "--omnibal-model", str(model_file)]
    preflight = [*base, "--omnibal-plan", str(tmp / "plan.json"), "--omnibal-precision", "fp32"]
    preflight[preflight.index("--seed") + 1] = str(CALIBRATION_SEED)
    return {"spec": spec, "request": request, "plan": plan, "base": base, "lengths": lengths,
            "model_file": model_file, "preflight": preflight}  # fmt: skip


def calibrate(prep: dict, args: argparse.Namespace, profile: Path) -> tuple[dict, float]:
    """(the calibrated profile, seconds) of one preflight of the plan with --calibrate."""
    start = time.perf_counter()
    torchrun(prep["plan"].parallel.pp, [
        "-m", "megatron_omnibal.preflight", *prep["preflight"], "--out",
        str(profile.with_suffix(".report.json")), "--calibrate", str(profile), "--worst-steps",
        "1", "--typical-steps", str(args.typical_steps)])  # fmt: skip
    return json.loads(profile.read_text()), time.perf_counter() - start


def plan_setting(prep: dict, profile: dict | None = None, path: Path | None = None):
    """(the planner's Setting, with the calibrated `profile` when given, and the plan's
    partition in it)."""
    from dataclasses import replace

    from megatron_omnibal.planner.make import plan_partition
    from megatron_omnibal.planner.search.setting import make_setting

    plan, request = prep["plan"], prep["request"]
    if profile is not None:
        request = replace(request, profile=profile, profile_path=str(path))
    setting = make_setting(request, 1, plan.parallel.pp, 1, plan.parallel.micro_batches)
    bounds, recompute = plan_partition(plan)
    return setting, setting.problem(float("inf")).evaluate(bounds, recompute)


def layout_flags(prep: dict, batching: str, args: argparse.Namespace, tmp: Path) -> list[str]:
    """The flags of one layout's timed run."""
    plan = prep["plan"]
    if batching == "balanced":
        return [*prep["base"], "--omnibal-plan", str(tmp / "plan.json"),
                "--omnibal-precision", "fp32"]  # fmt: skip
    _, part = plan_setting(prep)
    budgets = ["--omnibal-vit-budget", str(plan.data.vit_budget), "--omnibal-token-budget",
               str(plan.data.token_budget)]  # fmt: skip
    return [*prep["base"], *budgets, *bm.layout_flags(part, prep["spec"].vit.num_layers),
            "--omnibal-baseline-batch", str(args.samples_per_micro_batch)]  # fmt: skip


def predicted_ms(prep: dict, profile: dict, path: Path, batching: str, steps: list) -> float:
    """The median over a run's timed steps of the step the calibrated planner predicts."""
    setting, part = plan_setting(prep, profile, path)
    feats = [bm.step_features(prep["lengths"], s, batching == "baseline")[None] for s in steps]
    return float(statistics.median(setting.predict(part, f).step_ms for f in feats))


def refit(prep: dict, profile: Path) -> dict:
    """The profile of a saved round fitted again, by this code, from that round's saved
    preflight report (the same measurement; nothing runs)."""
    from megatron_omnibal.megatron.stages.layout import layout_from_plan
    from megatron_omnibal.preflight.calibrate import calibrated_profile

    plan, saved = prep["plan"], json.loads(profile.read_text())
    return calibrated_profile(
        report=json.loads(profile.with_suffix(".report.json").read_text()), spec=prep["spec"],
        layouts=[st.to_dict() for st in layout_from_plan(plan, plan.parallel.pp)],
        tiles=saved["measured"]["tiles"], tokens=saved["measured"]["tokens"],
        micro_batches=plan.parallel.micro_batches,
        memory_budget_gib=saved.get("memory_budget_gib"))  # fmt: skip


def timed_run(pp: int, mode: str, flags: list[str], out: Path, warmup: int) -> dict:
    torchrun(pp, [bm.__file__, "--worker", mode, str(out), "--", *flags])
    return saved_run(out, warmup)


def saved_run(out: Path, warmup: int) -> dict:
    """A timed run's step times (after `warmup` steps) and micro-batches."""
    rec = json.loads((out / "rank0.json").read_text())
    times = np.array(rec["train_step_ms"][warmup:])
    return {"median_ms": float(statistics.median(times)), "times_ms": times.tolist(),
            "micro_indices": rec["micro_indices"][warmup:]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help="comma-separated SHAPE:PP:balanced|baseline")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per layout")
    parser.add_argument("--steps", type=int, default=5, help="training steps per timed run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps of a run")
    parser.add_argument("--typical-steps", type=int, default=3,
                        help="typical steps of the calibrating preflight")  # fmt: skip
    parser.add_argument("--micro-batches", type=int, default=4, help="per step")
    parser.add_argument("--samples-per-micro-batch", type=int, default=4,
                        help="planned samples per micro-batch (the plan's global batch, and the "
                        "baseline's fixed micro-batch size)")  # fmt: skip
    parser.add_argument("--samples", type=int, default=3000, help="random subset of the data")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--refit", action="store_true",
                        help="run nothing: fit every round's profile again from its saved "
                        "preflight report in --work-dir and predict its saved run")  # fmt: skip
    args = parser.parse_args(argv)
    layouts = []
    for item in args.layouts.split(","):
        shape, pp, batching = (item.split(":") + ["", ""])[:3]
        if shape not in bm.SHAPES or not pp.isdigit() or int(pp) < 2 or batching not in (
                "balanced", "baseline"):  # fmt: skip
            parser.error(f"--layouts: {item!r} is not SHAPE:PP:balanced|baseline with a shape "
                         f"of {', '.join(bm.SHAPES)} and PP >= 2")  # fmt: skip
        layouts.append((shape, int(pp), batching))
    if args.steps - args.warmup < 1 or args.repeats < 1:
        parser.error("need at least one timed step (--steps > --warmup) and one repeat")
    if args.refit and args.work_dir is None:
        parser.error("--refit reads the rounds saved in a --work-dir")
    tmp = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_preflight_"))
    started, load = time.perf_counter(), [os.getloadavg()[0]]
    preps = {}
    for shape, pp, _ in layouts:
        if (shape, pp) not in preps:
            preps[shape, pp] = prepare(shape, pp, args, tmp / f"{shape}-pp{pp}")
    flags = {lay: layout_flags(preps[lay[:2]], lay[2], args, tmp / f"{lay[0]}-pp{lay[1]}")
             for lay in layouts}  # fmt: skip
    measured: dict = {lay: [] for lay in layouts}
    predicted: dict = {lay: [] for lay in layouts}
    preflight_s: dict = {lay: [] for lay in layouts}
    for r in range(args.repeats):  # rounds: every layout once, side by side
        for lay in layouts:
            folder = tmp / f"{lay[0]}-pp{lay[1]}"
            profile_path, run = folder / f"{lay[2]}.calibrated{r}.json", folder / f"{lay[2]}.run{r}"
            if args.refit:
                profile, got = refit(preps[lay[:2]], profile_path), saved_run(run, args.warmup)
            else:
                profile, seconds = calibrate(preps[lay[:2]], args, profile_path)
                preflight_s[lay].append(round(seconds, 1))
                got = timed_run(lay[1], lay[2], flags[lay], run, args.warmup)
            measured[lay].append(got)
            predicted[lay].append(predicted_ms(preps[lay[:2]], profile, profile_path, lay[2],
                                               got["micro_indices"]))  # fmt: skip
        load.append(os.getloadavg()[0])
    rows = []
    for lay in layouts:
        medians = [g["median_ms"] for g in measured[lay]]
        median = float(statistics.median(medians))
        prediction = float(statistics.median(predicted[lay]))
        rows.append({"shape": lay[0], "pp": lay[1], "batches": lay[2],
                     "measured_ms": round(median, 1), "predicted_ms": round(prediction, 1),
                     "error": round(prediction / median - 1, 4),
                     "noise": round((max(medians) - min(medians)) / median, 4),
                     "prediction_noise": round((max(predicted[lay]) - min(predicted[lay]))
                                               / prediction, 4),
                     "repeat_medians_ms": [round(x, 1) for x in medians],
                     "round_predictions_ms": [round(x, 1) for x in predicted[lay]],
                     "preflight_s": preflight_s[lay]})  # fmt: skip
    print(f"{'shape':<9} {'PP':>2} {'batches':<8} {'measured ms':>11} {'predicted ms':>12} "
          f"{'error':>7} {'noise':>6} {'pnoise':>6}  repeats (ms) / rounds' predictions (ms)")
    for row in rows:
        print(f"{row['shape']:<9} {row['pp']:>2} {row['batches']:<8} {row['measured_ms']:>11.1f} "
              f"{row['predicted_ms']:>12.1f} {row['error']:>+7.1%} {row['noise']:>6.1%} "
              f"{row['prediction_noise']:>6.1%}  {row['repeat_medians_ms']} / "
              f"{row['round_predictions_ms']}")  # fmt: skip
    within = sum(abs(r["error"]) <= 0.10 for r in rows)
    print(f"\n{within} of {len(rows)} layouts within 10% (goal: all, at least 4); largest error "
          f"{max(abs(r['error']) for r in rows):.1%}, largest noise "
          f"{max(r['noise'] for r in rows):.1%} (measured), "
          f"{max(r['prediction_noise'] for r in rows):.1%} (predicted); load average "
          f"{min(load):.1f}-{max(load):.1f}; {time.perf_counter() - started:.0f} s")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({
            "note": "CPU, gloo, one thread per rank; calibrated by the preflight on other steps",
            "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
            "load_average": load, "rows": rows}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
