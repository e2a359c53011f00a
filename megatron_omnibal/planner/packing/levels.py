"""Packing levels for hierarchical balance packing, chosen by the planner's time and memory model.

A pack's activations grow with its tiles and tokens, so one budget sized for the longest samples
makes every step carry the memory, and so the recompute, of the longest. With levels, short
samples go into short packs (more micro-batches per step, same tokens per step) that need less
recompute. For each candidate level this module picks each stage's cheapest recompute that fits
memory at the level's budgets (the planner's SegmentFrontier over the fixed partition), and it
picks the set of levels with the least estimated epoch time. `simulate_epoch` then measures a
balance plan by the planner's pipeline simulation over every step (each step with its level's
recompute), which is what the figures report.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from megatron_omnibal.balance.config import Level
from megatron_omnibal.balance.hierarchy import assign_levels
from megatron_omnibal.balance.plan_io import BalancePlan
from megatron_omnibal.data.lengths import LengthStats
from megatron_omnibal.planner.cost_model.costs import (
    GROUP_LLM,
    GROUP_VIT,
    MIB,
    CostModel,
    workload_features,
)
from megatron_omnibal.planner.cost_model.memory import inflight_1f1b, stage_memory_mib
from megatron_omnibal.planner.search.recompute import SegmentFrontier
from megatron_omnibal.planner.simulator.simulate import simulate

FILL = 0.95          # estimated share of a level's budgets a pack carries
MAX_LEVELS = 4
TILE_ROOM = 1.5     # a level's tiles: this times what its tokens hold at the data's mix


@dataclass(frozen=True)
class Pipeline:
    """The fixed model layout levels are planned for: stage bounds over the cost model's units,
    data-parallel size, GPU memory budget and the pipeline link."""

    cost_model: CostModel
    bounds: tuple[int, ...]
    dp: int
    memory_mib: float
    link_gbs: float
    p2p_latency_ms: float = 0.02

    @property
    def pp(self) -> int:
        return len(self.bounds) - 1


def _peak_costs(pipe: Pipeline, vit_budget: int, token_budget: int):
    """Layer costs of the largest pack a level allows: its budgets, one sample of all tokens."""
    return pipe.cost_model.at(workload_features([vit_budget], [token_budget],
                                                [float(token_budget) ** 2])[0])


def level_recompute(pipe: Pipeline, vit_budget: int, token_budget: int, micro_batches: int
                    ) -> list[dict[int, int]] | None:
    """Each stage's cheapest recompute counts (per group) that fit memory with packs at the
    budgets and 1F1B's micro-batches in flight; None if a stage cannot fit."""
    frontier = SegmentFrontier(_peak_costs(pipe, vit_budget, token_budget))
    out = []
    for s, (lo, hi) in enumerate(itertools.pairwise(pipe.bounds)):
        choice = frontier.choice(lo, hi, inflight_1f1b(s, pipe.pp, micro_batches),
                                 pipe.memory_mib)
        if choice is None:
            return None
        out.append(choice)
    return out


def with_recompute(level: Level, recompute: list[dict[int, int]]) -> Level:
    """The level with its per-stage ViT and LLM recompute counts."""
    return replace(level, vit_recompute=tuple(int(r.get(GROUP_VIT, 0)) for r in recompute),
                   llm_recompute=tuple(int(r.get(GROUP_LLM, 0)) for r in recompute))


def recompute_of(level: Level, pp: int) -> list[dict[int, int]]:
    """The level's per-stage counts as the planner's {group: count} per stage."""
    vit = level.vit_recompute or (0,) * pp
    llm = level.llm_recompute or (0,) * pp
    return [{GROUP_VIT: int(v), GROUP_LLM: int(t)} for v, t in zip(vit, llm, strict=True)]


def level_memory_mib(pipe: Pipeline, level: Level) -> np.ndarray:
    """(pp,) peak memory of each stage at the level's largest pack with its recompute and
    1F1B's micro-batches in flight (the model level_recompute fits)."""
    costs = _peak_costs(pipe, level.vit_budget, level.token_budget)
    recompute = recompute_of(level, pipe.pp)
    return np.array([stage_memory_mib(costs, lo, hi, recompute[s],
                                      inflight_1f1b(s, pipe.pp, level.micro_batches))
                     for s, (lo, hi) in enumerate(itertools.pairwise(pipe.bounds))])


def stage_times(pipe: Pipeline, features: np.ndarray, recompute: list[dict[int, int]]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pp, m) forward ms, backward (+ recompute) ms and (pp - 1, m) transfer ms of m packs."""
    costs = pipe.cost_model.at(features)  # arrays (U, m)
    group = np.asarray(costs.group)
    units = len(costs.names)
    fwd, bwd = [], []
    for s, (lo, hi) in enumerate(itertools.pairwise(pipe.bounds)):
        f = costs.forward_ms[lo:hi].sum(axis=0)
        b = costs.backward_ms[lo:hi].sum(axis=0)
        for g, k in recompute[s].items():
            idx = lo + np.flatnonzero(group[lo:hi] == g)[:k]
            b = b + costs.recompute_ms[idx].sum(axis=0)
        if lo == 0:
            f, b = f + costs.first.forward_ms, b + costs.first.backward_ms
        if hi == units:
            f, b = f + costs.last.forward_ms, b + costs.last.backward_ms
        fwd.append(f)
        bwd.append(b)
    out = np.asarray(costs.output_mib)[[b - 1 for b in pipe.bounds[1:-1]]]
    p2p = pipe.p2p_latency_ms + out * MIB / (pipe.link_gbs * 1e9) * 1e3
    return np.array(fwd), np.array(bwd), np.atleast_2d(p2p)


def step_ms(pipe: Pipeline, replicas: list[np.ndarray], recompute: list[dict[int, int]]
            ) -> float:
    """Simulated 1F1B step: the slowest replica's pipeline (features (m, 4) per replica)."""
    worst = 0.0
    for feats in replicas:
        f, b, p = stage_times(pipe, feats, recompute)
        worst = max(worst, simulate(f, b, pipe.pp, 1, p if pipe.pp > 1 else 0.0,
                                    keep_ops=False).makespan_ms)
    return worst


def candidate_levels(top: Level, lengths: LengthStats, floor_tokens: int = 1024) -> list[Level]:
    """Halvings of the top level's token budget (micro-batches doubled: the same tokens per
    step), down to `floor_tokens` or the median sample, whichever is larger. Tiles: TILE_ROOM
    times what the tokens hold at the data's tokens per tile (so packs are not tile-bound),
    at most the top level's."""
    floor = max(floor_tokens, int(np.median(lengths.tokens)))
    per_token = float(lengths.vit.sum()) / max(float(lengths.tokens.sum()), 1.0)
    out, k = [], 1
    while top.token_budget // 2**k >= floor:
        tokens = top.token_budget // 2**k
        tiles = min(top.vit_budget, max(1, math.ceil(tokens * per_token * TILE_ROOM)))
        out.append(Level(vit_budget=tiles, token_budget=tokens,
                         micro_batches=top.micro_batches * 2**k))
        k += 1
    return out[::-1]


@dataclass(frozen=True)
class LevelEstimate:
    """A level's share of an epoch as choose_levels estimates it: the samples it holds (those
    no shorter level fits), its steps and the ms of one step."""

    samples: int
    steps: int
    step_ms: float


def level_estimates(pipe: Pipeline, lengths: LengthStats, levels: tuple[Level, ...],
                    recompute: list[list[dict[int, int]]]) -> list[LevelEstimate]:
    """Per level, its samples' packs at FILL of the budgets, in whole steps of identical packs,
    each step simulated once. A level without samples of its own is timed with packs of the
    samples that fit it (the whole budgets with one sample if none does)."""
    level_of = assign_levels(lengths.vit, lengths.tokens, levels)
    out = []
    for i, lv in enumerate(levels):
        mine = level_of == i
        shape = mine if mine.any() else lv.fits(lengths.vit, lengths.tokens)
        v, t = lengths.vit[shape].sum(), lengths.tokens[shape].astype(np.float64)
        if not shape.any():
            v, t = lv.vit_budget, np.array([float(lv.token_budget)])
        packs = max(v / (lv.vit_budget * FILL) if lv.vit_budget else 0.0,
                    t.sum() / (lv.token_budget * FILL))
        feat = workload_features([v / packs], [t.sum() / packs], [(t * t).sum() / packs])
        replica = np.repeat(feat, lv.micro_batches, axis=0)
        steps = math.ceil(packs / (pipe.dp * lv.micro_batches)) if mine.any() else 0
        out.append(LevelEstimate(int(mine.sum()), steps,
                                 step_ms(pipe, [replica], recompute[i])))
    return out


def estimate_epoch_ms(pipe: Pipeline, lengths: LengthStats, levels: tuple[Level, ...],
                      recompute: list[list[dict[int, int]]]) -> float:
    """Epoch estimate: the levels' steps times their step times (level_estimates)."""
    return sum(e.steps * e.step_ms for e in level_estimates(pipe, lengths, levels, recompute))


def choose_levels(pipe: Pipeline, lengths: LengthStats, top: Level,
                  candidates: list[Level] | None = None) -> tuple[Level, ...]:
    """The set of levels (always ending with `top`) with the least estimated epoch time, each
    with its recompute; at most MAX_LEVELS levels."""
    cands = candidate_levels(top, lengths) if candidates is None else list(candidates)
    feasible = []
    for lv in [*cands, top]:
        rec = level_recompute(pipe, lv.vit_budget, lv.token_budget, lv.micro_batches)
        if rec is not None:
            feasible.append((lv, rec))
    if not feasible or feasible[-1][0] != top:
        raise ValueError(f"levels: the top level {top.vit_budget}/{top.token_budget} does not "
                         "fit memory even with every layer recomputed")
    *short, last = feasible
    best, best_ms = None, math.inf
    for r in range(min(len(short), MAX_LEVELS - 1) + 1):
        for subset in itertools.combinations(short, r):
            chosen = [*subset, last]
            levels = tuple(lv for lv, _ in chosen)
            ms = estimate_epoch_ms(pipe, lengths, levels, [rec for _, rec in chosen])
            if ms < best_ms:
                best, best_ms = chosen, ms
    return tuple(with_recompute(lv, rec) for lv, rec in best)


def parse_levels(text: str, top: Level) -> tuple[Level, ...]:
    """`--levels V/T[xM],..`: levels below `top` (without xM, micro-batches for the top's
    tokens per step), ascending, then `top`; listing the top itself is allowed."""
    out = []
    for part in text.split(","):
        level = Level.parse(part.strip(), top.micro_batches)
        if "x" not in part:
            micro = max(1, round(top.micro_batches * top.token_budget / level.token_budget))
            level = replace(level, micro_batches=micro)
        if (level.vit_budget, level.token_budget) == (top.vit_budget, top.token_budget):
            continue
        if level.token_budget >= top.token_budget or level.vit_budget > top.vit_budget:
            raise ValueError(f"--levels {part}: not below the plan's budgets "
                             f"{top.vit_budget}/{top.token_budget} (the last level)")
        out.append(level)
    if any(a.token_budget >= b.token_budget or a.vit_budget > b.vit_budget
           for a, b in itertools.pairwise(out)):
        raise ValueError(f"--levels {text}: levels must ascend (tokens strictly, tiles not "
                         "descending)")
    return (*out, top)


def fit_levels(pipe: Pipeline, levels: tuple[Level, ...]) -> tuple[Level, ...]:
    """Each level with its cheapest recompute that fits memory (level_recompute)."""
    out = []
    for lv in levels:
        rec = level_recompute(pipe, lv.vit_budget, lv.token_budget, lv.micro_batches)
        if rec is None:
            raise ValueError(f"level {lv.vit_budget}/{lv.token_budget} x{lv.micro_batches} does "
                             "not fit memory even with every layer recomputed")
        out.append(with_recompute(lv, rec))
    return tuple(out)


@dataclass(frozen=True)
class EpochTime:
    """Simulated epoch of a plan: total ms and, per level, steps, ms, tokens and samples."""

    total_ms: float
    per_level: tuple[dict, ...]


def simulate_epoch(pipe: Pipeline, plan: BalancePlan, lengths: LengthStats,
                   levels: tuple[Level, ...]) -> EpochTime:
    """Every step of the plan through the pipeline simulator with its level's recompute (the
    levels' own counts; none given: the cheapest that fits, level_recompute)."""
    recompute = []
    for lv in levels:
        if lv.vit_recompute or lv.llm_recompute:
            recompute.append(recompute_of(lv, pipe.pp))
        else:
            rec = level_recompute(pipe, lv.vit_budget, lv.token_budget, lv.micro_batches)
            if rec is None:
                raise ValueError(f"level {lv.vit_budget}/{lv.token_budget} does not fit memory")
            recompute.append(rec)
    pid = np.repeat(np.arange(plan.num_packs), np.diff(plan.pack_ptr))
    tok = lengths.tokens[plan.samples].astype(np.float64)
    feats = workload_features(np.bincount(pid, lengths.vit[plan.samples], plan.num_packs),
                              np.bincount(pid, tok, plan.num_packs),
                              np.bincount(pid, tok * tok, plan.num_packs))
    step_level = plan.step_levels()
    per = [dict(steps=0, ms=0.0, tokens=0.0, samples=0) for _ in levels]
    starts = np.searchsorted(plan.pack_step, np.arange(plan.num_steps + 1))
    sizes = np.diff(plan.pack_ptr)
    for s in range(plan.num_steps):
        lo, hi = starts[s], starts[s + 1]
        lv = int(step_level[s])
        replicas = [feats[lo:hi][plan.pack_rank[lo:hi] == r] for r in range(pipe.dp)]
        ms = step_ms(pipe, replicas, recompute[lv])
        per[lv]["steps"] += 1
        per[lv]["ms"] += ms
        per[lv]["tokens"] += float(feats[lo:hi, 1].sum())
        per[lv]["samples"] += int(sizes[lo:hi].sum())
    return EpochTime(sum(p["ms"] for p in per), tuple(per))
