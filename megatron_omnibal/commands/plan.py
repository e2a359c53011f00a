"""`omnibal plan`: data budgets, parallel sizes, partition and recompute -> plan.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "plan budgets, TP/PP, the stage partition and per-stage recompute (writes plan.json)"

EXAMPLE_LENGTHS = Path(__file__).resolve().parents[2] / "examples" / "data" / "internvl_subset.npz"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="preset name or a JSON/YAML model file")
    parser.add_argument("--hardware", required=True, help="preset name or a JSON/YAML GPU file")
    parser.add_argument("--gpus", type=int, required=True, help="total GPUs")
    parser.add_argument("--tp", type=int, help="tensor parallel size (searched when omitted)")
    parser.add_argument("--pp", type=int, help="pipeline parallel size (searched when omitted)")
    parser.add_argument(
        "--micro-batches",
        type=int,
        help="micro-batches per step and replica (default: best of 2 or 4 x PP)",
    )
    parser.add_argument(
        "--global-batch", type=int, default=1024, help="samples per optimizer step (default 1024)"
    )
    parser.add_argument(
        "--lengths",
        default=None,
        help="length statistics (any format load_lengths reads; default: the "
        "shipped InternVL subset)",
    )
    parser.add_argument(
        "--mode",
        choices=("exact", "bmp", "megatron"),
        default="exact",
        help="partition search (default exact)",
    )
    parser.add_argument(
        "--profile",
        help="measured layer profile from `omnibal profile` (TP 1) instead of the FLOPs model",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn batch")
    parser.add_argument("--out", default="plan.json", help="where to write the plan")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def print_table(plan: dict, out=sys.stdout) -> None:
    """The per-stage table and the predictions, for people."""
    par = plan["parallel"]
    print(
        f"{plan['model']} on {par['gpus']} x {plan['hardware']}: tp={par['tp']} "
        f"pp={par['pp']} dp={par['dp']} micro-batches={par['micro_batches']}",
        file=out,
    )
    data = plan["data"]
    print(
        f"budgets per micro-batch: {data['vit_budget']} tiles, {data['token_budget']} tokens",
        file=out,
    )
    print(
        f"{'stage':>5} {'vit layers':>11} {'proj':>4} {'llm layers':>11} {'fwd ms':>9} "
        f"{'bwd ms':>9} {'recompute v/l':>13} {'mem GiB':>8}",
        file=out,
    )
    for st in plan["stages"]:
        v, lm = st["vit_layers"], st["llm_layers"]
        vit = f"{v[0]}-{v[1] - 1}" if v[1] > v[0] else "-"
        llm = f"{lm[0]}-{lm[1] - 1}" if lm[1] > lm[0] else "-"
        print(
            f"{st['stage']:>5} {vit:>11} {'yes' if st['projector'] else '':>4} {llm:>11} "
            f"{st['forward_ms']:>9.1f} {st['backward_ms']:>9.1f} "
            f"{st['vit_recompute']:>6}/{st['llm_recompute']:<6} {st['peak_memory_gib']:>8.1f}",
            file=out,
        )
    p = plan["predicted"]
    fits = "" if p["baseline_fits_memory"] else " (does NOT fit memory)"
    print(
        f"predicted step: {p['step_ms']:.1f} ms (bubble {p['bubble_fraction']:.1%}); Megatron "
        f"baseline: {p['baseline_step_ms']:.1f} ms (bubble "
        f"{p['baseline_bubble_fraction']:.1%}){fits}; modeled speedup {p['speedup']:.2f}x",
        file=out,
    )
    print("megatron flags: " + " ".join(plan["megatron_flags"]), file=out)


def run(args: argparse.Namespace) -> int:
    from megatron_omnibal.data.lengths import load_lengths
    from megatron_omnibal.models.resolve import resolve_model
    from megatron_omnibal.planner.config_files import resolve_hardware
    from megatron_omnibal.planner.plan import make_plan

    model = resolve_model(args.model)
    hw = resolve_hardware(args.hardware)
    stats = load_lengths(args.lengths or EXAMPLE_LENGTHS)
    profile = None
    if args.profile:
        from megatron_omnibal.models.resolve import read_mapping

        profile = read_mapping(args.profile)
    plan = make_plan(
        model,
        hw,
        stats,
        args.gpus,
        args.tp,
        args.pp,
        args.micro_batches,
        args.global_batch,
        args.mode,
        args.seed,
        args.out,
        progress=sys.stderr.isatty(),
        profile=profile,
    )
    Path(args.out).write_text(json.dumps(plan, indent=1) + "\n")
    if args.json:
        print(json.dumps(plan, indent=1))
    else:
        print_table(plan)
        print(f"wrote {args.out}")
    return 0
