"""`omnibal simulate`: replay a plan's step in the pipeline simulator, with a Gantt chart."""

from __future__ import annotations

import argparse

from megatron_omnibal.cli_args import non_negative_int, png_file

HELP = "simulate a plan.json step (1F1B, real sample lengths) and draw its Gantt chart"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plan", required=True, help="plan.json from `omnibal plan`")
    parser.add_argument(
        "--png", type=png_file, help="write the Gantt chart of the slowest replica to this .png"
    )
    parser.add_argument(
        "--lengths",
        help="the plan's length file at another location (default: the path the plan "
        "recorded); refused unless it holds the lengths the plan was made from",
    )
    parser.add_argument(
        "--profile",
        help="a measured-profile plan's layer profile at another location (default: the path "
        "the plan recorded); refused unless unchanged",
    )
    parser.add_argument(
        "--seed", type=non_negative_int, help="seed of the drawn batch (default: the plan's)"
    )
    parser.add_argument(
        "--baseline",
        nargs="?",
        const="best",
        choices=("best", "same-parallel"),
        help="simulate a baseline instead: 'best' (the default): the best Megatron-LM "
        "configuration the plan's speedup is against; 'same-parallel': Megatron's layout at "
        "the plan's sizes (ViT on stage 0, even LLM split, full recompute); both on random "
        "fixed-size padded batches",
    )


def _request(plan, args: argparse.Namespace):
    """The plan's request, on the data (and profile) it was made from."""
    from megatron_omnibal.planner.plan_file.provenance import (
        load_recorded_lengths,
        load_recorded_profile,
    )
    from megatron_omnibal.planner.search.request import PlanRequest

    where = f"plan {args.plan}"
    lengths = args.lengths or plan.data.lengths_path
    if lengths is None:
        raise ValueError(f"{where} was made from in-memory lengths: give --lengths FILE")
    stats = load_recorded_lengths(lengths, plan.data.lengths_sha256, where)
    p = plan.predicted
    profile = None
    if p.cost_model == "measured profile":
        path = args.profile or p.profile_path
        if path is None:
            raise ValueError(f"{where} was made from an in-memory profile: give --profile FILE")
        profile = load_recorded_profile(path, p.profile_sha256, where)
    par = plan.parallel
    return PlanRequest(
        model=plan.model_spec,
        hardware=plan.hardware_spec,
        lengths=stats,
        lengths_path=str(lengths),
        gpus=par.gpus,
        tp=par.tp,
        pp=par.pp,
        micro_batches=par.micro_batches,
        global_batch=plan.data.global_batch_samples,
        mode=p.partition_mode,
        seed=args.seed if args.seed is not None else plan.data.seed,
        profile=profile,
        profile_path=None if profile is None else str(path),
    )


def print_epochs(plan, setting, bounds, lengths) -> None:
    """The plan's epoch balanced with its packing levels and with its budgets alone, every
    step simulated with its level's recompute, per level."""
    from megatron_omnibal.planner.packing.level_plan import pipeline, simulate_plan_epoch

    pipe = pipeline(setting, bounds)
    epochs = [simulate_plan_epoch(plan, pipe, lengths, levels) for levels in (True, False)]
    print(
        f"epoch with packing levels: {epochs[0].total_ms / 1e3:.1f} s, one level at the "
        f"budgets: {epochs[1].total_ms / 1e3:.1f} s (every step simulated, modeled)"
    )
    print(f"{'level':>13} {'micro':>5} {'steps':>6} {'ms/step':>10} {'samples':>8}")
    rows = [(lv, p) for lv, p in zip(plan.data.levels, epochs[0].per_level, strict=True)]
    rows.append((plan.data.levels[-1], epochs[1].per_level[0]))
    for i, (lv, p) in enumerate(rows):
        label = f"{lv.vit_budget}/{lv.token_budget}" + (" alone" if i == len(rows) - 1 else "")
        print(
            f"{label:>13} {lv.micro_batches:>5} {p['steps']:>6} "
            f"{p['ms'] / max(p['steps'], 1):>10.1f} {p['samples']:>8}"
        )


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from megatron_omnibal.planner.make import plan_partition
    from megatron_omnibal.planner.plan_file.plan import load_plan
    from megatron_omnibal.planner.search.baseline import (
        BaselineConfig,
        baseline_from_config,
        same_parallel_baseline,
    )
    from megatron_omnibal.planner.search.setting import make_setting
    from megatron_omnibal.planner.simulator.simulate import simulate

    plan = load_plan(args.plan)
    request = _request(plan, args)
    par, data = plan.parallel, plan.data
    budgets = (data.vit_budget, data.token_budget)
    if args.baseline == "best":
        b = plan.predicted.baseline
        if b is None:
            raise ValueError(
                f"plan {args.plan}: no Megatron-LM configuration fits memory, so there is no "
                "baseline to simulate"
            )
        config = BaselineConfig(b.tp, b.pp, b.dp, b.micro_batch_size, b.micro_batches,
                                b.llm_layers_per_stage, b.recompute_vision,
                                b.recompute_num_layers, b.vpp, b.ep)  # fmt: skip
        base = baseline_from_config(request, config)
        setting, part, result = base.setting, base.part, base.result
        features, kind = setting.fixed, "best Megatron-LM baseline"
    elif args.baseline == "same-parallel":
        setting = make_setting(request, par.tp, par.pp, par.dp, par.micro_batches, budgets,
                               ep=par.ep)  # fmt: skip
        part, result, _ = same_parallel_baseline(setting)
        features, kind = setting.fixed, "Megatron layout at the plan's sizes"
    else:
        setting = make_setting(request, par.tp, par.pp, par.dp, par.micro_batches, budgets,
                               ep=par.ep)  # fmt: skip
        bounds, recompute = plan_partition(plan)
        part = replace(setting.problem(float("inf")).evaluate(bounds, recompute), vpp=par.vpp)
        features, kind = setting.balanced, "plan, balanced batches"
        result = setting.predict(part, features)
    print(
        f"{kind}: step {result.step_ms:.4f} ms = slowest replica's pipeline "
        f"{result.pipeline_ms:.3f} ms + gradient sync {result.sync_ms:.3f} ms; bubble "
        f"{result.bubble_fraction:.1%}; replicas {result.replica_ms.min():.1f} .. "
        f"{result.replica_ms.max():.1f} ms (modeled)"
    )
    print(f"{'stage':>5} {'busy ms':>10} {'idle ms':>10}")
    for s in range(setting.pp):
        print(f"{s:>5} {result.busy_ms[s]:>10.1f} {result.idle_ms[s]:>10.1f}")
    if plan.data.levels and args.baseline is None:
        print_epochs(plan, setting, part.bounds, request.lengths)
    if args.png:
        from megatron_omnibal.planner.simulator.gantt import save_gantt

        r = int(result.replica_ms.argmax())
        fwd, bwd = setting.stage_times(part, features[r])
        line = simulate(fwd, bwd, setting.pp, part.vpp, setting.stage_p2p(part, features[r]))
        save_gantt(
            line,
            args.png,
            f"{plan.model_spec.name} tp={setting.tp} pp={setting.pp} dp={setting.dp}, slowest "
            f"replica, {kind}: {line.makespan_ms:.0f} ms, bubble {line.bubble_fraction:.1%} "
            "(modeled)",
        )
        print(f"wrote {args.png}")
    return 0
