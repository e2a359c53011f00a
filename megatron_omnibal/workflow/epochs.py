"""Training steps of whole epochs: the balanced sampler decides how many steps an epoch has,
and epochs differ (epoch e is balanced with seed + e), so `epochs` becomes `--train-iters` by
balancing each epoch as training will."""

from __future__ import annotations

from pathlib import Path

from megatron_omnibal.balance.balancer import balance
from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.data.lengths import load_lengths
from megatron_omnibal.planner.plan_file.plan import load_plan


def epoch_iterations(plan_path: Path, lengths_path: Path, epochs: int, seed: int) -> int:
    """Steps of `epochs` epochs of the length file under the plan's budgets and sizes (a plan
    made without packing levels, as the workflow makes it)."""
    plan = load_plan(plan_path)
    config = BalanceConfig(
        dp_size=plan.parallel.dp,
        micro_batches=plan.parallel.micro_batches,
        vit_budget=plan.data.vit_budget,
        token_budget=plan.data.token_budget,
        seed=seed,
        cost=plan.data.pack_cost,
    )
    lengths = load_lengths(lengths_path)
    return sum(balance(lengths, config.with_seed(seed + e)).num_steps for e in range(epochs))
