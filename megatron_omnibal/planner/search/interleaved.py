"""Partition search for interleaved 1F1B: units cut into pp x vpp virtual stages.

Megatron's interleaved schedule gives rank r the chunks c = 0..vpp-1, chunk c holding virtual
stage c x pp + r, so a rank's chunks are non-adjacent slices of [ViT layers, projector, LLM
layers]. They share the rank's memory: at each of the schedule's peaks (`inflight_states`) the
rank holds a different number of micro-batches of each chunk. Recompute is chosen per chunk,
jointly per rank: the counts with the least total recompute time whose every peak fits the
budget (ties: fewer recomputed layers). That joint choice couples a rank's chunks, so the
per-segment tables that make the 1F1B search a DP no longer give exact stage times; here they
only bound them from below (each chunk alone, at its own largest in-flight count, with the
budget less the least static state any other chunk can hold), and the branch and bound of
`exact.certify` times every full split it reaches with the rank-joint recompute. The result is
the optimum over all splits under that recompute rule, within `tolerance`, and proven so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from megatron_omnibal.planner.cost_model.memory import (
    inflight_states,
    stage_memory_mib,
    stage_time_ms,
)
from megatron_omnibal.planner.search.exact import certify, longest_paths, pipeline_graph
from megatron_omnibal.planner.search.partition import (
    NoFeasiblePartition,
    Partition,
    Problem,
    forward_table,
    min_max_bounds,
    polish,
)
from megatron_omnibal.planner.search.recompute import pareto_front
from megatron_omnibal.planner.simulator.simulate import simulate

SCREEN_TOLERANCE = 0.05
# The lower-bound tables ignore how a rank's chunks share memory, so on full-size models the
# proof rarely closes: past this many nodes the search stops with the best split found and a
# lower bound that still holds (its gap is reported).
MAX_NODES = 5_000


@dataclass(frozen=True)
class RankChoice:
    """A rank's recompute per chunk (counts per group), its time and memory."""

    counts: tuple[dict[int, int], ...]
    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]  # recompute included
    memory_mib: float


def check_interleaved(units: int, pp: int, vpp: int, m: int) -> None:
    """Megatron's conditions for the interleaved schedule, and one unit per virtual stage."""
    if pp < 2 or vpp < 2:
        raise ValueError(f"interleaved 1F1B needs pp >= 2 and vpp >= 2, got pp={pp}, vpp={vpp}")
    if m % pp:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({m}) divisible by pp ({pp})")
    if pp * vpp > units:
        raise ValueError(
            f"{pp} x {vpp} virtual stages for {units} partition units: every virtual stage "
            "needs at least one"
        )


class InterleavedProblem:
    """A `partition.Problem` (costs, micro-batches, budget, transfers) over pp x vpp stages."""

    def __init__(self, problem: Problem, pp: int, vpp: int):
        check_interleaved(problem.units, pp, vpp, problem.m)
        self.base, self.pp, self.vpp = problem, pp, vpp
        self.nv = pp * vpp
        self.states = [
            np.array(inflight_states(r, pp, vpp, problem.m), np.float64) for r in range(pp)
        ]
        self.choose = functools.lru_cache(maxsize=65536)(self._choose)
        frontier = problem.frontier
        units = problem.units
        self.forward = forward_table(problem.costs)
        single = frontier.static[np.arange(units), np.arange(units) + 1]
        others = (vpp - 1) * float(single.min())
        self.lower_tables = []  # per virtual stage: a lower bound on its backward ms
        for v in range(self.nv):
            r, c = v % pp, v // pp
            total = frontier.stage_times(int(self.states[r][:, c].max()), problem.budget - others)
            self.lower_tables.append(
                np.subtract(
                    total, self.forward, out=np.full_like(total, np.inf), where=np.isfinite(total)
                )
            )

    @functools.cache  # noqa: B019 (one problem per search; freed with it)
    def front(self, lo: int, hi: int) -> tuple:
        """Segment [lo, hi)'s recompute options: saved MiB, ms, layers, counts, groups."""
        saved, cost, combos, groups = pareto_front(self.base.costs, lo, hi)
        return saved, cost, np.array([sum(c) for c in combos]), combos, groups

    def _choose(self, rank: int, segments: tuple[tuple[int, int], ...]) -> RankChoice | None:
        """The least total recompute ms over the rank's chunks that fits at every peak."""
        costs, states, budget = self.base.costs, self.states[rank], self.base.budget
        frontier = self.base.frontier
        static = sum(float(frontier.static[lo, hi]) for lo, hi in segments)
        fronts = [self.front(lo, hi) for lo, hi in segments]
        stored = [
            frontier.act_full[lo, hi] - f[0] for (lo, hi), f in zip(segments, fronts, strict=True)
        ]
        cost = np.zeros(1)
        layers = np.zeros(1, np.int64)
        memory = np.zeros((1, len(states)))
        picks = np.zeros((1, 0), np.int64)
        least_rest = [
            sum(float(s.min()) * states[:, j] for j, s in enumerate(stored) if j > c)
            for c in range(len(segments))
        ]
        for c, (front, store) in enumerate(zip(fronts, stored, strict=True)):
            cost = (cost[:, None] + front[1][None, :]).ravel()
            layers = (layers[:, None] + front[2][None, :]).ravel()
            memory = (memory[:, None, :] + store[None, :, None] * states[None, None, :, c]).reshape(
                -1, len(states)
            )
            picks = np.concatenate(
                [
                    np.repeat(picks, len(store), axis=0),
                    np.tile(np.arange(len(store)), len(picks))[:, None],
                ],
                axis=1,
            )
            ok = np.all(memory + least_rest[c] + static <= budget + 1e-6, axis=1)
            cost, layers, memory, picks = cost[ok], layers[ok], memory[ok], picks[ok]
            if not len(cost):
                return None
            cost, layers, memory, picks = _pareto(cost, layers, memory, picks)
        best = int(np.lexsort((layers, cost))[0])
        counts = tuple(
            dict(zip(f[4], f[3][i], strict=True))
            for f, i in zip(fronts, picks[best].tolist(), strict=True)
        )
        times = [
            stage_time_ms(costs, lo, hi, k) for (lo, hi), k in zip(segments, counts, strict=True)
        ]
        return RankChoice(
            counts,
            tuple(t[0] for t in times),
            tuple(t[1] for t in times),
            static + float(memory[best].max()),
        )

    def rank_segments(self, bounds: tuple[int, ...], rank: int) -> tuple[tuple[int, int], ...]:
        return tuple(
            (bounds[c * self.pp + rank], bounds[c * self.pp + rank + 1]) for c in range(self.vpp)
        )

    def times(self, bounds: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, list]:
        """Per virtual stage forward and backward ms (inf: some rank does not fit) and the
        choices per rank (None where it does not fit)."""
        fwd, bwd = np.full(self.nv, np.inf), np.full(self.nv, np.inf)
        choices = [self.choose(r, self.rank_segments(bounds, r)) for r in range(self.pp)]
        for r, ch in enumerate(choices):
            if ch is not None:
                fwd[r :: self.pp] = ch.forward_ms
                bwd[r :: self.pp] = ch.backward_ms
        return fwd, bwd, choices

    def evaluate(self, parts: list[tuple[int, ...]]) -> tuple[np.ndarray, list]:
        """Exact steps (and critical paths) of full splits; inf where a rank does not fit."""
        rows = [self.times(p)[:2] for p in parts]
        f = np.array([r[0] for r in rows])
        b = np.array([r[1] for r in rows])
        link = np.array([self.base.p2p[list(p[1:-1])] for p in parts])
        ok = np.all(np.isfinite(f) & np.isfinite(b), axis=1)
        spans = np.full(len(parts), np.inf)
        sigs = []
        if np.any(ok):
            graph = pipeline_graph(self.pp, self.base.m, self.vpp)
            spans[ok], sigs = longest_paths(graph, f[ok], b[ok], link[ok], paths=True)
        return spans, sigs

    def steps(self, parts: list[tuple[int, ...]]) -> np.ndarray:
        return self.evaluate(parts)[0]


def _pareto(cost, layers, memory, picks):
    """Drop options another beats or ties on time, layers and memory at every peak."""
    order = np.lexsort((layers, cost))
    keep: list[int] = []
    for i in order.tolist():
        if keep and np.any(
            np.all(memory[keep] <= memory[i] + 1e-9, axis=1)
            & (cost[keep] <= cost[i])
            & (layers[keep] <= layers[i])
        ):
            continue
        keep.append(i)
    return cost[keep], layers[keep], memory[keep], picks[keep]


def min_max_split(tables: list[np.ndarray]) -> tuple[int, ...] | None:
    """Least-bottleneck contiguous split over per-stage tables (None: no split is finite)."""
    value, bounds = min_max_bounds(tables)
    return tuple(bounds) if np.isfinite(value) else None


def incumbent(ip: InterleavedProblem) -> tuple[tuple[int, ...] | None, float]:
    """A first split: the least bottleneck with each chunk held to 1/vpp of the budget at its
    largest in-flight count (fits by construction), else with the lower-bound tables."""
    frontier, budget = ip.base.frontier, ip.base.budget
    share = [
        frontier.stage_times(int(ip.states[v % ip.pp][:, v // ip.pp].max()), budget / ip.vpp)
        for v in range(ip.nv)
    ]
    lower = [t + ip.forward for t in ip.lower_tables]
    cands = [b for b in (min_max_split(share), min_max_split(lower)) if b is not None]
    if not cands:
        return None, np.inf
    spans = ip.steps(cands)
    i = int(np.argmin(spans))
    return cands[i], float(spans[i])


def search_interleaved(
    problem: Problem,
    pp: int,
    vpp: int,
    tolerance: float | None = 1e-3,
    max_nodes: int = MAX_NODES,
    max_evaluations: int = 2048,
) -> Partition:
    """The fastest split into pp x vpp virtual stages with rank-joint recompute.

    Without `tolerance` (screening), the incumbent polished by boundary shifts; with it, branch
    and bound proves the result within `tolerance` of the optimum (`lower_bound_ms`), unless
    `max_nodes` stops it first (the bound still holds).
    """
    ip = InterleavedProblem(problem, pp, vpp)
    best, step = incumbent(ip)
    if best is not None and np.isfinite(step):
        best, step = polish(best, step, ip.steps, max_evaluations)
    lower = np.nan
    if tolerance is None and (best is None or not np.isfinite(step)):
        tolerance = SCREEN_TOLERANCE  # screening found nothing that fits: search until it does
    if tolerance is not None:
        seed = best or min_max_split([t + ip.forward for t in ip.lower_tables])
        if seed is not None:
            cert = certify(
                ip.forward,
                ip.lower_tables,
                problem.p2p,
                problem.m,
                seed,
                tolerance=tolerance,
                max_nodes=max_nodes,
                vpp=vpp,
                evaluate=ip.evaluate,
                improve=lambda b, t: polish(b, t, ip.steps, max_evaluations),
            )
            best, step, lower = cert.bounds, cert.step_ms, cert.lower_bound_ms
    if best is None or not np.isfinite(step):
        raise NoFeasiblePartition(
            f"no split into {pp} x {vpp} virtual stages fits {problem.budget / 1024:.2f} GiB "
            "per GPU with each rank's chunks recomputed as needed"
        )
    return interleaved_partition(ip, best, step, lower)


def interleaved_partition(
    ip: InterleavedProblem, bounds: tuple[int, ...], step: float, lower: float
) -> Partition:
    """A `Partition` over virtual stages; memory_mib is the peak of the rank holding each."""
    fwd, bwd, choices = ip.times(tuple(bounds))
    counts, memory = [], []
    for v in range(ip.nv):
        ch = choices[v % ip.pp]
        counts.append(ch.counts[v // ip.pp])
        memory.append(ch.memory_mib)
    return Partition(
        tuple(bounds),
        tuple(counts),
        fwd,
        bwd,
        np.array(memory),
        step,
        step_ms=step,
        lower_bound_ms=min(lower, step) if np.isfinite(lower) else np.nan,
        vpp=ip.vpp,
    )


def evaluate_interleaved(
    problem: Problem,
    bounds: tuple[int, ...],
    recompute: list[dict[int, int]],
    pp: int,
    vpp: int,
) -> Partition:
    """A given split into pp x vpp virtual stages with given recompute: stage times, each
    rank's peak memory (`inflight_states`) and the step with identical micro-batches."""
    costs, m = problem.costs, problem.m
    stages = list(zip(bounds[:-1], bounds[1:], strict=True))
    times = np.array(
        [stage_time_ms(costs, lo, hi, k) for (lo, hi), k in zip(stages, recompute, strict=True)]
    )
    static = np.array(
        [
            stage_memory_mib(costs, lo, hi, k, 0)
            for (lo, hi), k in zip(stages, recompute, strict=True)
        ]
    )
    stored = (
        np.array(
            [
                stage_memory_mib(costs, lo, hi, k, 1)
                for (lo, hi), k in zip(stages, recompute, strict=True)
            ]
        )
        - static
    )
    memory = np.zeros(len(stages))
    for r in range(pp):
        states = np.array(inflight_states(r, pp, vpp, m), np.float64)
        memory[r::pp] = static[r::pp].sum() + float((states @ stored[r::pp]).max())
    fwd, bwd = times[:, 0], times[:, 1]
    link = problem.p2p[list(bounds[1:-1])][:, None]
    step = simulate(
        np.repeat(fwd[:, None], m, 1), np.repeat(bwd[:, None], m, 1), pp, vpp, link, keep_ops=False
    ).makespan_ms
    return Partition(tuple(bounds), tuple(recompute), fwd, bwd, memory, step, step_ms=step, vpp=vpp)
