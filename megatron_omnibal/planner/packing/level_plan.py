"""The data side of a plan for the balancer: the modeled time of a pack and the packing levels.

`omnibal plan` hands the balancer the model's cost of a tile, a token and a squared token per
stage of the chosen partition (so packs are balanced by modeled time, attention included), and
with `--levels` the packing levels of hierarchical balance packing, each with the per-stage
recompute the planner's memory model fits at its budgets and micro-batches, and its predicted
step. `omnibal simulate` rebuilds the same pipeline from a plan to simulate its epoch.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_omnibal.balance.balancer import balance
from megatron_omnibal.balance.config import BalanceConfig, Level
from megatron_omnibal.data.lengths import LengthStats
from megatron_omnibal.planner.cost_model.memory import GIB_MIB
from megatron_omnibal.planner.packing.levels import (
    EpochTime,
    Pipeline,
    choose_levels,
    fit_levels,
    level_estimates,
    level_memory_mib,
    parse_levels,
    recompute_of,
    simulate_epoch,
)
from megatron_omnibal.planner.plan_file.plan import LevelPrediction, Plan
from megatron_omnibal.planner.search.setting import Setting, budget_mib


def pipeline(setting: Setting, bounds: tuple[int, ...]) -> Pipeline:
    """The levels' view of a configuration: its cost model, stage bounds, DP size, memory
    budget and pipeline link (unbounded when a measured transfer time holds the bytes)."""
    latency, per_mib = setting.p2p_terms()
    link = setting.link_gbs() if per_mib > 0 else float("inf")
    return Pipeline(setting.model, tuple(bounds), setting.dp, budget_mib(setting.hw), link,
                    latency)  # fmt: skip


@dataclass(frozen=True)
class LevelPlan:
    """Levels (empty when one level is best) with one prediction each, and the estimated
    epoch (s) with them and with the budgets' level alone."""

    levels: tuple[Level, ...]
    predictions: tuple[LevelPrediction, ...]
    epoch_s: float
    single_level_epoch_s: float


def plan_levels(pipe: Pipeline, lengths: LengthStats, top: Level, spec: str) -> LevelPlan:
    """`spec` 'auto': the levels of least estimated epoch (choose_levels); else the given
    'V/T[xM],..' below `top`. The top level gets its own fitted recompute too (its largest
    pack: one sample of all its tokens), so every level is planned by the same memory model."""
    if spec == "auto":
        levels = choose_levels(pipe, lengths, top)
    else:
        levels = fit_levels(pipe, parse_levels(spec, top))
    estimates = _estimates(pipe, lengths, levels)
    epoch = _epoch_s(estimates)
    single_epoch = _epoch_s(_estimates(pipe, lengths, levels[-1:]))
    if len(levels) == 1:
        return LevelPlan((), (), epoch, single_epoch)
    predictions = tuple(
        LevelPrediction(
            step_ms=round(e.step_ms, 4),
            samples=e.samples,
            steps=e.steps,
            peak_memory_gib=tuple(round(float(m) / GIB_MIB, 3)
                                  for m in level_memory_mib(pipe, lv)),
        )
        for lv, e in zip(levels, estimates, strict=True)
    )
    return LevelPlan(levels, predictions, epoch, single_epoch)


def _estimates(pipe: Pipeline, lengths: LengthStats, levels: tuple[Level, ...]) -> list:
    return level_estimates(pipe, lengths, levels, [recompute_of(lv, pipe.pp) for lv in levels])


def _epoch_s(estimates: list) -> float:
    return round(sum(e.steps * e.step_ms for e in estimates) / 1e3, 3)


def simulate_plan_epoch(plan: Plan, pipe: Pipeline, lengths: LengthStats,
                        levels: bool = True) -> EpochTime:
    """The plan's balanced epoch (its budgets, DP size, micro-batches, seed, pack cost and, with
    `levels`, its levels) through the pipeline simulator, every step with its level's
    recompute; without `levels`, one level at the budgets with the top level's recompute."""
    d, par = plan.data, plan.parallel
    config = BalanceConfig(dp_size=par.dp, micro_batches=par.micro_batches,
                           vit_budget=d.vit_budget, token_budget=d.token_budget, seed=d.seed,
                           cost=d.pack_cost, levels=d.levels if levels else ())
    return simulate_epoch(pipe, balance(lengths, config), lengths,
                          d.levels if levels else d.levels[-1:])
