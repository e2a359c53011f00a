"""Partition search: cut the units [ViT layers, projector, LLM layers] into P pipeline stages.

`search` is exact for its objective over all contiguous partitions jointly with per-stage
recompute counts under a memory budget. With uniform micro-batches 1F1B takes about
(m - 1) x slowest stage + sum of stages + pipeline transfers, so it minimises that: for a
bound B on the slowest stage, a DP finds the least stage sum with every stage <= B (each stage
taking its own cheapest recompute that fits, which is exact because a stage's recompute touches
only its own time and memory); B runs over the distinct stage times from the least feasible
bottleneck (a min-max DP) upward until (m - 1) B + least possible sum can no longer win.
The best few are then ranked by the exact event-driven 1F1B simulation.
Megatron's default split and OmniBal's BMP are here as comparison modes.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field, replace

import numpy as np

from megatron_omnibal.planner.cost_model.costs import GROUP_NONE, GROUP_VIT, LayerCosts
from megatron_omnibal.planner.cost_model.memory import (
    GIB_MIB,
    inflight_1f1b,
    stage_memory_mib,
    stage_time_ms,
)
from megatron_omnibal.planner.search.exact import certify, partition_steps
from megatron_omnibal.planner.search.recompute import SegmentFrontier
from megatron_omnibal.planner.simulator.simulate import simulate


class NoFeasiblePartition(ValueError):
    """No partition fits the memory budget; the message names the stage and the shortfall."""


@dataclass(frozen=True)
class Partition:
    """Stage boundaries (P + 1, from 0 to U) with each stage's recompute counts per group."""

    bounds: tuple[int, ...]
    recompute: tuple[dict[int, int], ...]
    forward_ms: np.ndarray
    backward_ms: np.ndarray  # including recompute
    memory_mib: np.ndarray
    objective_ms: float
    step_ms: float = field(default=float("nan"))
    lower_bound_ms: float = field(default=float("nan"))  # no partition's step is below it
    vpp: int = 1  # > 1: the stages are virtual, chunk c of rank r is stage c x pp + r

    @property
    def stages(self) -> list[tuple[int, int]]:
        return list(itertools.pairwise(self.bounds))

    @property
    def pp(self) -> int:
        return (len(self.bounds) - 1) // self.vpp


class Problem:
    """Costs of one micro-batch per unit, the schedule size, memory budget and link costs."""

    def __init__(
        self,
        costs: LayerCosts,
        micro_batches: int,
        budget_mib: float = np.inf,
        boundary_p2p_ms: np.ndarray | float = 0.0,
        first_stage_min_end: int = 0,
    ):
        """`first_stage_min_end`: units stage 0 must hold at least (the whole vision side when
        the ViT is pinned to the first stage, as Megatron-Bridge and ms-swift run it)."""
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.costs = costs
        self.m = micro_batches
        self.budget = float(budget_mib)
        self.units = len(costs)
        p2p = np.broadcast_to(np.asarray(boundary_p2p_ms, np.float64), (self.units + 1,)).copy()
        p2p[0] = p2p[-1] = 0.0
        self.p2p = p2p  # p2p[b]: one transfer across the boundary before unit b
        self.first_stage_min_end = first_stage_min_end

    @functools.cached_property
    def frontier(self) -> SegmentFrontier:
        """Cheapest recompute per segment, made on first use: with layers that differ within a
        tower (Qwen2.5-VL's windowed and full-attention blocks, a measured profile) it is a
        Pareto front per segment, and a problem the baseline search only evaluates at given
        recompute counts never needs it."""
        return SegmentFrontier(self.costs)

    def tables(self, pp: int) -> list[np.ndarray]:
        out = [
            self.frontier.stage_times(inflight_1f1b(s, pp, self.m), self.budget) for s in range(pp)
        ]
        if self.first_stage_min_end:  # stage 0 may not end before that unit
            out[0] = out[0].copy()
            out[0][:, : self.first_stage_min_end] = np.inf
        return out

    def objective(self, stage_ms: np.ndarray, bounds: tuple[int, ...]) -> float:
        return float(
            (self.m - 1) * stage_ms.max() + stage_ms.sum() + 2 * self.p2p[list(bounds[1:-1])].sum()
        )

    def evaluate(
        self, bounds: tuple[int, ...], recompute: list[dict[int, int]] | None = None
    ) -> Partition:
        """A partition with given boundaries; recompute defaults to each stage's cheapest fit."""
        pp = len(bounds) - 1
        counts, fwd, bwd, mem = [], [], [], []
        for s, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            n = inflight_1f1b(s, pp, self.m)
            if recompute is None:
                c = self.frontier.choice(lo, hi, n, self.budget)
                if c is None:
                    c = {
                        g: int(np.sum(self.costs.group[lo:hi] == g))
                        for g in set(self.costs.group[lo:hi].tolist())
                        if g >= 0
                    }
            else:
                c = recompute[s]
            f, b = stage_time_ms(self.costs, lo, hi, c)
            counts.append(c)
            fwd.append(f)
            bwd.append(b)
            mem.append(stage_memory_mib(self.costs, lo, hi, c, n))
        fwd_a, bwd_a = np.array(fwd), np.array(bwd)
        part = Partition(
            tuple(bounds),
            tuple(counts),
            fwd_a,
            bwd_a,
            np.array(mem),
            self.objective(fwd_a + bwd_a, bounds),
        )
        return _with_step(self, part)

    def fits(self, part: Partition) -> bool:
        return bool(np.all(part.memory_mib <= self.budget + 1e-6))


def _with_step(problem: Problem, part: Partition) -> Partition:
    """Attach the exact 1F1B simulated step time with identical micro-batches."""
    pp, m = len(part.bounds) - 1, problem.m
    fwd = np.repeat(part.forward_ms[:, None], m, axis=1)
    bwd = np.repeat(part.backward_ms[:, None], m, axis=1)
    p2p = problem.p2p[list(part.bounds[1:-1])][:, None] if pp > 1 else 0.0
    step = simulate(fwd, bwd, pp, 1, p2p, keep_ops=False).makespan_ms
    return replace(part, step_ms=step)


def _check_pp(problem: Problem, pp: int) -> None:
    if pp < 1:
        raise ValueError(f"pipeline size must be >= 1, got {pp}")
    if pp > problem.units:
        raise ValueError(
            f"pipeline size {pp} is larger than the {problem.units} partition units "
            f"({problem.costs.names[0]} .. {problem.costs.names[-1]}): every stage "
            "needs at least one"
        )


def min_max_bounds(tables: list[np.ndarray]) -> tuple[float, list[int]]:
    """Least achievable maximum over stages, with boundaries."""
    u = tables[0].shape[0] - 1
    best = np.full(u + 1, np.inf)
    best[0] = 0.0
    args = []
    for t in tables:
        cand = np.maximum(best[:, None], t)
        args.append(cand.argmin(axis=0))
        best = cand.min(axis=0)
    return float(best[u]), _backtrack(args, u)


def _min_sum(tables: list[np.ndarray], bound: float, p2p: np.ndarray) -> tuple[float, list[int]]:
    """Least sum of stage times (+ 2 transfers per interior boundary), every stage <= bound."""
    u = tables[0].shape[0] - 1
    cost = np.full(u + 1, np.inf)
    cost[0] = 0.0
    edge = 2 * p2p[:, None]
    args = []
    for t in tables:
        tot = cost[:, None] + np.where(t <= bound, t, np.inf) + edge
        args.append(tot.argmin(axis=0))
        cost = tot.min(axis=0)
    return float(cost[u]), _backtrack(args, u)


def _backtrack(args: list[np.ndarray], u: int) -> list[int]:
    bounds = [u]
    for a in reversed(args):
        bounds.append(int(a[bounds[-1]]))
    return bounds[::-1]


def _infeasible(problem: Problem, pp: int) -> NoFeasiblePartition:
    """Explain: the split with the least worst overshoot even with everything recomputed."""
    over = [
        problem.frontier.min_memory_mib(inflight_1f1b(s, pp, problem.m)) - problem.budget
        for s in range(pp)
    ]
    _, bounds = min_max_bounds(over)
    worst = max(range(pp), key=lambda s: over[s][bounds[s], bounds[s + 1]])
    lo, hi = bounds[worst], bounds[worst + 1]
    short = over[worst][lo, hi] / GIB_MIB
    names = problem.costs.names
    return NoFeasiblePartition(
        f"no partition into {pp} stages fits {problem.budget / GIB_MIB:.2f} GiB per GPU: even "
        f"with every layer recomputed, the best split leaves stage {worst} ({names[lo]} .. "
        f"{names[hi - 1]}) {short:.2f} GiB short (it needs "
        f"{(problem.budget + over[worst][lo, hi]) / GIB_MIB:.2f} GiB); use more GPUs "
        "(tensor/pipeline parallel), fewer tokens per micro-batch, or a larger GPU"
    )


def objective_candidates(problem: Problem, pp: int) -> dict[tuple[int, ...], float]:
    """Partitions visited by the exact (m - 1) max + sum search, with their objective.

    The least value among them is the exact optimum of that objective.
    """
    _check_pp(problem, pp)
    tables = problem.tables(pp)
    b_star, _ = min_max_bounds(tables)
    if not np.isfinite(b_star):
        raise _infeasible(problem, pp)
    s_min, _ = _min_sum(tables, np.inf, problem.p2p)
    if problem.m == 1:
        candidates = np.array([np.inf])
    else:
        values = np.concatenate([t[np.isfinite(t)] for t in tables])
        candidates = np.unique(values[values >= b_star])
    found: dict[tuple[int, ...], float] = {}
    best = np.inf
    for bound in candidates:
        if problem.m > 1 and (problem.m - 1) * bound + s_min >= best - 1e-9 * abs(best):
            break
        total, bounds = _min_sum(tables, bound, problem.p2p)
        if not np.isfinite(total):
            continue
        stage = np.array([tables[s][bounds[s], bounds[s + 1]] for s in range(pp)])
        value = problem.objective(stage, tuple(bounds))
        found[tuple(bounds)] = value
        best = min(best, value)
    return found


def search(
    problem: Problem,
    pp: int,
    refine: int = 8,
    max_evaluations: int = 2048,
    tolerance: float | None = 1e-3,
    max_nodes: int = 50_000,
) -> Partition:
    """The fastest partition under the exact 1F1B simulation, found through two exact DPs.

    Candidates: the best `refine` of the exact (m - 1) max + sum search, the exact minimiser
    of the 1F1B lower bound and BMP's split; the fastest when simulated is polished by moving
    boundaries (at most `max_evaluations` simulations). With a `tolerance`, unless the lower
    bound already certifies the polished split, branch and bound (`exact.certify`) proves the
    result within `tolerance` of the true optimum, or finds one that is; `max_nodes` caps its
    work. `lower_bound_ms` of the result bounds every partition's step from below either way,
    so step_ms / lower_bound_ms - 1 certifies the gap.
    """
    found = objective_candidates(problem, pp)
    tables = problem.tables(pp)
    forward = forward_table(problem.costs)
    backward = [
        np.subtract(t, forward, out=np.full_like(t, np.inf), where=np.isfinite(t)) for t in tables
    ]

    def steps(parts: list[tuple[int, ...]]) -> np.ndarray:
        return partition_steps(forward, backward, problem.p2p, problem.m, parts)[0]

    ranked = sorted(found, key=found.get)[: max(1, refine)]
    lower, lb_bounds = _min_lower_bound(tables, problem.m, problem.p2p)
    ranked.append(tuple(lb_bounds))
    with contextlib.suppress(NoFeasiblePartition):
        ranked.append(bmp(problem, pp).bounds)
    spans = steps(ranked)
    best, best_step = polish(
        ranked[int(np.argmin(spans))], float(spans.min()), steps, max_evaluations
    )
    if tolerance is not None and best_step > lower * (1 + tolerance):
        cert = certify(
            forward,
            backward,
            problem.p2p,
            problem.m,
            best,
            tolerance=tolerance,
            max_nodes=max_nodes,
            improve=lambda b, t: polish(b, t, steps, max_evaluations),
        )
        best, best_step = cert.bounds, cert.step_ms
        lower = max(lower, cert.lower_bound_ms)
    part = problem.evaluate(best)
    return replace(part, lower_bound_ms=min(lower, part.step_ms))


def forward_table(costs: LayerCosts) -> np.ndarray:
    """(U+1, U+1): forward ms of segment [lo, hi) with the pinned first/last work; inf if empty."""
    u = len(costs)
    cum = np.concatenate([[0.0], np.cumsum(costs.forward_ms)])
    out = cum[None, :] - cum[:, None]
    out[0, :] += float(costs.first.forward_ms)
    out[:, u] += float(costs.last.forward_ms)
    out[np.tril_indices(u + 1)] = np.inf
    return out


def _min_lower_bound(
    tables: list[np.ndarray], m: int, p2p: np.ndarray, rel_tol: float = 1e-9
) -> tuple[float, list[int]]:
    """Least over partitions of max_s (work before s + m x t_s): a lower bound on any 1F1B step.

    Stage s cannot start before micro-batch 0 has passed the stages before it, nor finish
    before its last gradient has passed them back, and it works m x t_s in between. For a
    target X, a DP keeps the least prefix time at each (stage, boundary) subject to
    prefix + m x t <= X (a smaller prefix never hurts later stages); bisection finds the least X.
    """
    u = tables[0].shape[0] - 1
    edge = 2 * p2p[:, None]

    def feasible(x: float) -> list[int] | None:
        prefix = np.full(u + 1, np.inf)
        prefix[0] = 0.0
        args = []
        for t in tables:
            start = prefix[:, None] + edge
            tot = np.where(start + m * t <= x, start + t, np.inf)
            args.append(tot.argmin(axis=0))
            prefix = tot.min(axis=0)
        return _backtrack(args, u) if np.isfinite(prefix[u]) else None

    lo = 0.0
    hi = sum(float(np.min(t[np.isfinite(t)])) for t in tables) * (m + 1) + 2 * float(p2p.sum())
    hi = max(hi, 1e-12)
    while feasible(hi) is None:
        hi *= 2
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        if feasible(mid) is None:
            lo = mid
        else:
            hi = mid
    return hi, feasible(hi)


def polish(
    bounds: tuple[int, ...], step: float, steps, max_evaluations: int
) -> tuple[tuple[int, ...], float]:
    """Hill-climb on the simulated step: shift any run of consecutive boundaries by one unit.

    The (m - 1) max + sum objective ignores how warm-up and drain overlap with a slow stage's
    work in 1F1B; the simulation does not, and a neighbouring split can be faster. All moves
    of a round are simulated at once (`steps`: boundary tuples -> step ms).
    """
    pp = len(bounds) - 1
    moves = [(range(i, j), d) for i in range(1, pp) for j in range(i + 1, pp + 1) for d in (-1, 1)]
    seen = {bounds}
    while len(seen) <= max_evaluations:
        cands = []
        for idx, d in moves:
            b = list(bounds)
            for i in idx:
                b[i] += d
            bt = tuple(b)
            if bt not in seen and all(x < y for x, y in itertools.pairwise(bt)):
                seen.add(bt)
                cands.append(bt)
        if not cands:
            break
        spans = steps(cands)
        i = int(np.argmin(spans))
        if spans[i] >= step - 1e-9:
            break
        bounds, step = cands[i], float(spans[i])
    return bounds, step


def megatron_default(problem: Problem, pp: int, full_recompute: bool = True) -> Partition:
    """Megatron's VLM layout: the whole vision side on stage 0, LLM layers split evenly.

    The vision side is every ViT unit plus the non-recomputable units after it (projector);
    LLM layers are spread as evenly as possible, later stages taking the remainder (a profile
    with no LLM layers is split evenly as a whole). With
    `full_recompute`, every layer is recomputed (the baseline); otherwise the cheapest fit.
    """
    _check_pp(problem, pp)
    group = np.asarray(problem.costs.group)
    vision = 0
    while vision < len(group) and group[vision] in (GROUP_VIT, GROUP_NONE):
        vision += 1
    if vision == problem.units:  # a profile without an LLM group: Megatron's even split
        vision = 0
    llm = problem.units - vision
    if llm < pp:
        raise ValueError(f"Megatron's layout needs at least {pp} LLM layers, the model has {llm}")
    sizes = [llm // pp + (1 if s >= pp - llm % pp else 0) for s in range(pp)]
    bounds = [0, vision + sizes[0]]
    for n in sizes[1:]:
        bounds.append(bounds[-1] + n)
    recompute = None
    if full_recompute:
        recompute = [
            {g: int(np.sum(group[lo:hi] == g)) for g in set(group[lo:hi].tolist()) if g >= 0}
            for lo, hi in itertools.pairwise(bounds)
        ]
    return problem.evaluate(tuple(bounds), recompute)


def bmp(problem: Problem, pp: int, max_enumerate: int = 6561) -> Partition:
    """OmniBal's Balanced Model Partition: greedy anchor, then its radius-1 neighbourhood.

    The anchor cuts where the running stage time (no recompute) crosses k/P of the total.
    Candidates move each boundary by -1, 0 or +1; those that fit memory are ranked by the
    variance of stage times (with their cheapest recompute), then by bytes sent between stages.
    Past `max_enumerate` candidates, boundaries are improved one at a time instead.
    """
    _check_pp(problem, pp)
    tables = problem.tables(pp)
    c = problem.costs
    unit = np.asarray(c.forward_ms + c.backward_ms, np.float64).copy()
    unit[0] += float(c.first.forward_ms + c.first.backward_ms)
    unit[-1] += float(c.last.forward_ms + c.last.backward_ms)
    cum = np.cumsum(unit)
    anchor = [0]
    for k in range(1, pp):
        b = int(np.argmin(np.abs(cum - cum[-1] * k / pp))) + 1
        anchor.append(min(max(b, anchor[-1] + 1), problem.units - (pp - k)))
    anchor.append(problem.units)
    out = np.concatenate([[0.0], np.asarray(c.output_mib, np.float64)])

    def rank(bounds: tuple[int, ...]) -> tuple[float, float]:
        if any(b >= e for b, e in itertools.pairwise(bounds)):
            return (np.inf, np.inf)
        t = np.array([tables[s][bounds[s], bounds[s + 1]] for s in range(pp)])
        if not np.all(np.isfinite(t)):
            return (np.inf, np.inf)
        return (float(t.var()), float(out[list(bounds[1:-1])].sum()))

    if 3 ** (pp - 1) <= max_enumerate:
        cands = [
            tuple([0, *(a + d for a, d in zip(anchor[1:-1], ds, strict=True)), problem.units])
            for ds in itertools.product((-1, 0, 1), repeat=pp - 1)
        ]
        best = min(cands, key=rank)
    else:
        best = tuple(anchor)
        improved = True
        while improved:
            improved = False
            for i in range(1, pp):
                for d in (-1, 1):
                    cand = best[:i] + (best[i] + d,) + best[i + 1 :]
                    if abs(cand[i] - anchor[i]) <= 1 and rank(cand) < rank(best):
                        best, improved = cand, True
    if not np.isfinite(rank(best)[0]):
        raise NoFeasiblePartition(
            f"BMP: no partition within one layer of the balanced anchor {anchor} fits "
            f"{problem.budget / GIB_MIB:.2f} GiB per GPU"
        )
    return problem.evaluate(best)
