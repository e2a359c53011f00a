"""`omnibal balance`: plan balanced micro-batches for one epoch and compare with random batching.

Prints, for the plan and for random batching with the same samples per step, the per-step
max/mean across DP ranks of tiles, tokens and cost (mean over steps and p99), OmniBal's dist and
pad ratios and the dataset-mix skew; writes the plan with --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from megatron_omnibal.cli_args import (
    fraction,
    non_negative_int,
    output_file,
    output_file_type,
    pack_cost,
    png_file,
    positive_float,
    positive_int,
)

if TYPE_CHECKING:
    from megatron_omnibal.balance.config import PackCost
    from megatron_omnibal.data.lengths import LengthStats

HELP = "balance samples into packs over (step, DP rank, micro-batch); compare with random"
LONG_INPUT = 200_000  # samples from which a progress bar is shown


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("lengths", help="length statistics (.npz, JSON list, meta JSON, JSONL)")
    parser.add_argument("--dp", type=positive_int, required=True, help="data-parallel ranks")
    parser.add_argument("--micro-batches", type=positive_int, default=1,
                        help="packs per rank per step (default 1)")
    parser.add_argument("--vit-budget", type=non_negative_int, help="image tiles per pack")
    parser.add_argument("--token-budget", type=positive_int, help="tokens per pack")
    parser.add_argument("--auto-budget", action="store_true",
                        help="choose the budgets from the data (see --samples-per-pack)")
    parser.add_argument("--samples-per-pack", type=positive_float, default=4.0,
                        help="with --auto-budget: target samples per pack (default 4)")
    parser.add_argument("--max-vit-budget", type=non_negative_int,
                        help="with --auto-budget: memory limit on tiles per pack")
    parser.add_argument("--max-token-budget", type=positive_int,
                        help="with --auto-budget: memory limit on tokens per pack")
    parser.add_argument("--mode", choices=("random", "grouped"), default="random",
                        help="random: each step's mix as random as a shuffle (default); "
                             "grouped: similar packs in the same step, tightest balance")
    parser.add_argument("--algorithm", choices=("default", "isf"), default="default",
                        help="default: slot balancing; isf: OmniBal's ISF, for comparison")
    parser.add_argument("--oversize", choices=("error", "solo", "skip"), default="error",
                        help="a sample larger than a budget: error (default), a pack of its "
                             "own, or listed as skipped")
    parser.add_argument("--cost", metavar="A,B,C", type=pack_cost,
                        help="modeled time of a pack: A*tiles + B*tokens + C*sum(len^2) (ms), "
                             "balanced beside tokens (default: tokens + sum(len^2) / 12288)")
    parser.add_argument("--plan", metavar="PLAN.json",
                        help="take the modeled time from an `omnibal plan` file: its "
                             "data.pack_cost, else its model, hardware and stages")
    parser.add_argument("--model", help="modeled time from this model (preset, spec file or "
                                        "HF directory) on --hardware, as one stage")
    parser.add_argument("--hardware", help="GPU preset for --model (e.g. A100-80G)")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="with --model: tensor parallel size")
    parser.add_argument("--tail-tolerance", type=fraction, default=0.015,
                        help="random mode: packs over the mean tokens or modeled time (or the "
                             "full tiles) by more than this share, and the lightest packs "
                             "while what they lack in tiles, tokens or time costs more than "
                             "it, get steps of their own among packs alike (default 0.015; "
                             "smaller: tighter balance, more steps with a skewed dataset mix)")
    parser.add_argument("--levels", metavar="V/T[xM],..",
                        help="packing levels (hierarchical balance packing), ascending, the "
                             "last one the budgets; xM: micro-batches per rank of its steps "
                             "(default: the same tokens per step as the budgets' level)")
    parser.add_argument("--curriculum-steps", type=non_negative_int, default=0,
                        help="with --levels: this many steps of the shortest level first")
    parser.add_argument("--isf-rounds", type=positive_int, default=10,
                        help="ISF rounds (default 10)")
    parser.add_argument("--isf-threshold", type=non_negative_int,
                        help="ISF: a pack with this many tokens is full (default budget - 128)")
    parser.add_argument("--baseline-samples", type=positive_int,
                        help="samples per micro-batch of the random baseline (default: the "
                             "plan's samples per micro-batch, rounded)")
    parser.add_argument("--seed", type=non_negative_int, default=0,
                        help="seed of the plan and of random batching (default 0)")
    parser.add_argument("--out", type=output_file_type(".npz"), metavar="PLAN.npz",
                        help="write the plan to this .npz file")
    parser.add_argument("--json", dest="json_out", type=output_file, metavar="FILE",
                        help="write the figures as JSON to this file")
    parser.add_argument("--png", type=png_file,
                        help="plot per-step, per-rank tiles and tokens of the plan beside random "
                             "batching to this .png file")


def run(args: argparse.Namespace) -> int:
    from megatron_omnibal.balance import metrics
    from megatron_omnibal.balance.balancer import balance
    from megatron_omnibal.balance.budgets import auto_budget
    from megatron_omnibal.balance.config import BalanceConfig
    from megatron_omnibal.balance.plan_io import save_plan
    from megatron_omnibal.data.lengths import load_lengths

    if args.auto_budget == (args.vit_budget is not None or args.token_budget is not None):
        raise ValueError("give either --vit-budget and --token-budget, or --auto-budget")
    if not args.auto_budget and (args.vit_budget is None or args.token_budget is None):
        raise ValueError("--vit-budget and --token-budget go together")
    lengths = load_lengths(args.lengths)
    cost = _cost(args, lengths)
    _check_enough_samples(args, len(lengths))
    long_input = len(lengths) >= LONG_INPUT
    bar = tqdm(total=3, desc="balance", unit="stage", disable=not long_input, file=sys.stderr)
    if args.auto_budget:
        vit_budget, token_budget = auto_budget(
            lengths, samples_per_pack=args.samples_per_pack,
            max_vit_budget=args.max_vit_budget, max_token_budget=args.max_token_budget)
    else:
        vit_budget, token_budget = args.vit_budget, args.token_budget
    bar.set_postfix_str("packing")
    start = time.perf_counter()
    config = BalanceConfig(dp_size=args.dp, micro_batches=args.micro_batches,
                           vit_budget=vit_budget, token_budget=token_budget, seed=args.seed,
                           mode=args.mode, algorithm=args.algorithm, oversize=args.oversize,
                           cost=cost, tail_tolerance=args.tail_tolerance,
                           isf_rounds=args.isf_rounds, isf_threshold=args.isf_threshold,
                           levels=_levels(args.levels, args.micro_batches, token_budget),
                           curriculum_steps=args.curriculum_steps)
    plan = balance(lengths, config)
    if plan.num_steps == 0:
        raise ValueError(f"{args.lengths}: all {len(lengths)} samples exceed the budgets and "
                         "--oversize skip leaves every one out: no plan")
    elapsed = time.perf_counter() - start
    bar.update()
    metric_cost = cost or metrics.DEFAULT_COST
    bar.set_postfix_str("metrics")
    ours = metrics.summarize(plan, lengths, metric_cost, seed=args.seed)
    bar.update()
    bar.set_postfix_str("random baseline")
    per_micro = _baseline_samples(args, ours["samples_per_step"], len(lengths))
    base_plan = metrics.random_batching(lengths, dp_size=args.dp,
                                        micro_batches=args.micro_batches,
                                        samples_per_micro=per_micro, seed=args.seed)
    base = metrics.summarize(base_plan, lengths, metric_cost, packed=False, seed=args.seed)
    bar.update()
    bar.close()
    _print_table(plan.meta, ours, base, per_micro, elapsed, len(lengths))
    if args.out:
        save_plan(plan, args.out)
        print(f"wrote {args.out}")
    if args.png:
        from megatron_omnibal.data.stats.plots import plot_balance

        print(f"wrote {plot_balance(plan, base_plan, lengths, args.png)}")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump({"meta": plan.meta, "plan": ours, "random_batching": base,
                       "baseline_samples_per_micro": per_micro, "seconds": elapsed}, fh,
                      indent=2)
        print(f"wrote {args.json_out}")
    return 0


def _check_enough_samples(args: argparse.Namespace, samples: int) -> None:
    """A step gives every one of the dp x micro-batches slots a pack: with fewer samples than
    slots even the first step would train empty packs, so such a plan is refused (before any
    work: it also stops a mistyped --dp from allocating packs for minutes)."""
    if samples == 0:
        raise ValueError(f"{args.lengths}: no samples")
    slots = args.dp * args.micro_batches
    if samples < slots:
        raise ValueError(f"{args.lengths} has {samples} sample(s), fewer than the {slots} packs "
                         f"of one step (--dp {args.dp} x --micro-batches {args.micro_batches}); "
                         "lower --dp or --micro-batches")


def _baseline_samples(args: argparse.Namespace, plan_samples_per_step: float, samples: int
                      ) -> int:
    """Samples per micro-batch of random batching: the plan's per pack, rounded, as long as the
    data fills one whole step of them (random batching drops an incomplete last step)."""
    slots = args.dp * args.micro_batches
    most = samples // slots
    if args.baseline_samples is not None:
        if args.baseline_samples > most:
            raise ValueError(f"--baseline-samples {args.baseline_samples}: {slots} micro-batches "
                             f"of that many need more than the {samples} samples; at most "
                             f"{most}")
        return args.baseline_samples
    return max(1, min(most, round(plan_samples_per_step / slots)))


def _levels(text: str | None, micro: int, token_budget: int) -> tuple:
    """--levels V/T[xM],..: without xM, micro-batches for the same tokens per step as the last."""
    from megatron_omnibal.balance.config import Level

    if not text:
        return ()
    out = []
    for part in text.split(","):
        try:
            level = Level.parse(part, micro)
        except ValueError as exc:
            raise ValueError(f"--levels {text}: {exc}") from exc
        if "x" not in part:
            level = Level(vit_budget=level.vit_budget, token_budget=level.token_budget,
                          micro_batches=max(1, round(micro * token_budget / level.token_budget)))
        out.append(level)
    return tuple(out)


def _cost(args: argparse.Namespace, lengths: LengthStats) -> PackCost | None:
    """The PackCost: --cost, else the plan's, else --model on --hardware (a native-resolution
    model's attention priced at the length file's own image sizes); None without any."""
    from megatron_omnibal.balance.config import PackCost

    given = [flag for flag, v in (("--cost", args.cost), ("--plan", args.plan),
                                  ("--model", args.model)) if v]
    if len(given) > 1:
        raise ValueError(f"give one of {', '.join(given)} for the modeled time")
    if args.cost:
        return PackCost.parse(args.cost)
    if args.plan:
        from megatron_omnibal.planner.plan_file.plan import load_plan

        plan = load_plan(args.plan)
        if plan.data.pack_cost is None:
            raise ValueError(f"--plan {args.plan}: the plan holds no data.pack_cost")
        return plan.data.pack_cost
    if args.model:
        if not args.hardware:
            raise ValueError("--model needs --hardware")
        from megatron_omnibal.data.lengths import load_image_tiles, tiles_per_image
        from megatron_omnibal.models.resolve import resolve_model
        from megatron_omnibal.planner.cost_model.hardware import get_hardware
        from megatron_omnibal.planner.packing.pack_cost import model_pack_cost

        images = tiles_per_image(lengths, load_image_tiles(args.lengths))
        return model_pack_cost(resolve_model(args.model), get_hardware(args.hardware), args.tp,
                               args.dp, image_tiles=images)
    return None


_ROWS = (
    ("tiles max/mean", "tiles_max_mean", "{:.4f}"),
    ("tiles max/mean p99", "tiles_max_mean_p99", "{:.4f}"),
    ("tokens max/mean", "tokens_max_mean", "{:.4f}"),
    ("tokens max/mean p99", "tokens_max_mean_p99", "{:.4f}"),
    ("modeled time max/mean", "time_max_mean", "{:.4f}"),
    ("modeled time p99", "time_max_mean_p99", "{:.4f}"),
    ("dist ratio tiles", "tiles_dist_ratio", "{:.4f}"),
    ("dist ratio tokens", "tokens_dist_ratio", "{:.4f}"),
    ("pad ratio", "pad_ratio", "{:.4f}"),
    ("mix skew (TV)", "mix_skew", "{:.4f}"),
    ("mix skew / shuffle's", "mix_skew_ratio", "{:.3f}"),
    ("steps", "steps", "{:.0f}"),
    ("samples per step", "samples_per_step", "{:.1f}"),
    ("samples trained", "trained_samples", "{:.0f}"),
    ("samples skipped", "skipped_samples", "{:.0f}"),
    ("empty packs", "empty_packs", "{:.0f}"),
)


def _print_table(meta: dict, ours: dict, base: dict, per_micro: int, elapsed: float,
                 samples: int) -> None:
    print(f"{samples} samples, dp {meta['dp']}, {meta['micro_batches']} micro-batch(es) per "
          f"rank per step, budgets {meta['vit_budget']} tiles / {meta['token_budget']} tokens, "
          f"algorithm {meta['algorithm']}, mode {meta['mode']}, seed {meta['seed']}")
    head = f"random batching ({per_micro}/micro)"
    print(f"{'metric':<24}{'plan':>14}{head:>30}")
    for label, key, fmt in _ROWS:
        print(f"{label:<24}{fmt.format(ours[key]):>14}{fmt.format(base[key]):>30}")
    print(f"balancing took {elapsed:.2f} s")
