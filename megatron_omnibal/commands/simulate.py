"""`omnibal simulate`: replay a plan's step in the pipeline simulator, with a Gantt chart."""

from __future__ import annotations

import argparse

HELP = "simulate a plan.json step (1F1B, real sample lengths) and draw its Gantt chart"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, help="plan.json from `omnibal plan`")
    parser.add_argument("--png", help="write the Gantt chart of the slowest replica here")
    parser.add_argument("--lengths", default=None, help="length statistics (default: shipped)")
    parser.add_argument("--seed", type=int, help="seed of the drawn batch (default: the plan's)")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="simulate the Megatron baseline instead (ViT on stage 0, even LLM split, full "
        "recompute, random fixed-size batches)",
    )


def run(args: argparse.Namespace) -> int:
    from megatron_omnibal.commands.plan import EXAMPLE_LENGTHS
    from megatron_omnibal.data.lengths import load_lengths
    from megatron_omnibal.models.spec import ModelSpec
    from megatron_omnibal.planner.config_files import resolve_hardware
    from megatron_omnibal.planner.hardware import Hardware
    from megatron_omnibal.planner.plan import (
        baseline,
        load_plan,
        make_setting,
        partition_from_plan,
    )
    from megatron_omnibal.planner.simulate import simulate

    plan = load_plan(args.plan)
    model = ModelSpec.from_dict(plan["model_spec"], f"{args.plan}: model_spec")
    hw = (
        Hardware(**plan["hardware_spec"])
        if "hardware_spec" in plan
        else resolve_hardware(plan["hardware"])
    )
    par, data = plan["parallel"], plan["data"]
    stats = load_lengths(args.lengths or EXAMPLE_LENGTHS)
    seed = args.seed if args.seed is not None else data.get("seed", 0)
    setting = make_setting(
        model,
        hw,
        stats,
        par["tp"],
        par["pp"],
        par["dp"],
        par["micro_batches"],
        data.get("global_batch_samples", 1024),
        seed,
        (data["vit_budget"], data["token_budget"]),
    )
    if args.baseline:
        part, result, _ = baseline(setting)
        features = setting.fixed
    else:
        bounds, recompute = partition_from_plan(plan, model)
        part = setting.problem(float("inf")).evaluate(bounds, recompute)
        features = setting.balanced
        result = setting.predict(part, features)
    print(
        f"step {result.step_ms:.3f} ms = slowest replica's pipeline {result.pipeline_ms:.3f} ms "
        f"+ gradient sync {result.sync_ms:.3f} ms; bubble {result.bubble_fraction:.1%}; "
        f"replicas {result.replica_ms.min():.1f} .. {result.replica_ms.max():.1f} ms (modeled)"
    )
    print(f"{'stage':>5} {'busy ms':>10} {'idle ms':>10}")
    for s in range(par["pp"]):
        print(f"{s:>5} {result.busy_ms[s]:>10.1f} {result.idle_ms[s]:>10.1f}")
    if args.png:
        from megatron_omnibal.planner.gantt import save_gantt

        r = int(result.replica_ms.argmax())
        fwd, bwd = setting.stage_times(part, features[r])
        line = simulate(fwd, bwd, par["pp"], 1, setting.stage_p2p(part, features[r]))
        kind = "Megatron baseline" if args.baseline else "plan, balanced batches"
        save_gantt(
            line,
            args.png,
            f"{plan['model']} tp={par['tp']} pp={par['pp']} "
            f"dp={par['dp']}, slowest replica, {kind}: {line.makespan_ms:.0f} ms, "
            f"bubble {line.bubble_fraction:.1%} (modeled)",
        )
        print(f"wrote {args.png}")
    return 0
