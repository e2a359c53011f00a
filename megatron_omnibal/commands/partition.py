"""`omnibal partition`: the best split of a measured layer profile into pipeline stages."""

from __future__ import annotations

import argparse
import json

from megatron_omnibal.cli_args import positive_float, positive_int

HELP = "split a layer profile into PP stages (exact search, or Megatron/BMP for comparison)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", required=True, help="layer profile JSON (`omnibal profile`)")
    parser.add_argument("--pp", type=positive_int, required=True, help="pipeline stages")
    parser.add_argument("--mode", choices=("exact", "bmp", "megatron"), default="exact")
    parser.add_argument(
        "--memory-gib",
        type=positive_float,
        help="per-GPU memory budget (overrides the profile's memory_budget_gib)",
    )
    parser.add_argument("--json", action="store_true", help="print {stages, step_ms, ...} JSON")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from megatron_omnibal.planner.cost_model.costs import load_profile
    from megatron_omnibal.planner.cost_model.memory import GIB_MIB
    from megatron_omnibal.planner.search.partition import Problem, bmp, megatron_default, search

    costs, options = load_profile(args.profile)
    budget = args.memory_gib if args.memory_gib is not None else options.get("memory_budget_gib")
    problem = Problem(
        costs,
        options["micro_batches"],
        np.inf if budget is None else budget * GIB_MIB,
        options.get("p2p_ms", 0.0),
    )
    if args.mode == "exact":
        part = search(problem, args.pp)
    elif args.mode == "bmp":
        part = bmp(problem, args.pp)
    else:
        part = megatron_default(problem, args.pp, full_recompute=True)
    doc = {
        "stages": [list(s) for s in part.stages],
        "step_ms": round(part.step_ms, 6),
        "recompute": [int(sum(r.values())) for r in part.recompute],
        "memory_gib": [round(float(x) / GIB_MIB, 4) for x in part.memory_mib],
        "mode": args.mode,
    }
    if args.mode == "exact":
        doc["lower_bound_ms"] = round(part.lower_bound_ms, 6)
        doc["proven_gap"] = round(part.step_ms / part.lower_bound_ms - 1, 6)
    if args.json:
        print(json.dumps(doc))
        return 0
    names = costs.names
    print(
        f"{'stage':>5} {'layers':>24} {'fwd ms':>9} {'bwd ms':>9} {'recompute':>9} {'mem GiB':>8}"
    )
    for s, (lo, hi) in enumerate(part.stages):
        print(
            f"{s:>5} {names[lo] + ' .. ' + names[hi - 1]:>24} {part.forward_ms[s]:>9.2f} "
            f"{part.backward_ms[s]:>9.2f} {doc['recompute'][s]:>9} {doc['memory_gib'][s]:>8.2f}"
        )
    print(f"1F1B step ({problem.m} micro-batches): {part.step_ms:.2f} ms")
    if args.mode == "exact":
        print(
            f"no partition is faster than {part.lower_bound_ms:.2f} ms "
            f"(proven within {doc['proven_gap']:.3%} of the optimum)"
        )
    return 0
