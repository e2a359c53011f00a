"""Recompute choice per stage: the fewest milliseconds of recomputation that fit memory.

Megatron's block method recomputes the first k layers of a stage's block, per tower, so a
stage's options are (k_vit, k_llm). A stage's choice touches only its own time and memory, so
the cheapest feasible choice per (segment, in-flight count) is exact for the joint search.
`SegmentFrontier` precomputes, for every contiguous segment, the Pareto front of (activation
saved per micro-batch, recompute ms) over all options, so queries for any budget are a lookup.
"""

from __future__ import annotations

import itertools

import numpy as np

from megatron_omnibal.planner.costs import LayerCosts
from megatron_omnibal.planner.memory import stage_memory_mib, stage_time_ms


def _group_prefixes(costs: LayerCosts, lo: int, hi: int) -> list[tuple[int, np.ndarray,
                                                                          np.ndarray]]:
    """Per recompute group in [lo, hi): (group, saved MiB prefix sums, recompute ms prefix)."""
    group = np.asarray(costs.group[lo:hi])
    saved = np.asarray(costs.activation_mib[lo:hi] - costs.checkpoint_mib[lo:hi], np.float64)
    rec = np.asarray(costs.recompute_ms[lo:hi], np.float64)
    out = []
    for g in np.unique(group[group >= 0]):
        idx = np.flatnonzero(group == g)
        out.append((int(g), np.concatenate([[0.0], np.cumsum(saved[idx])]),
                    np.concatenate([[0.0], np.cumsum(rec[idx])])))
    return out


def _frontier(prefixes: list) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]]:
    """Pareto front over all count combinations: saved ascending, cheapest cost for >= saved."""
    if not prefixes:
        return np.zeros(1), np.zeros(1), [()]
    saved = np.zeros(1)
    cost = np.zeros(1)
    for _, s, c in prefixes:
        saved = (saved[:, None] + s[None, :]).ravel()
        cost = (cost[:, None] + c[None, :]).ravel()
    combos = list(itertools.product(*[range(len(s)) for _, s, _ in prefixes]))
    order = np.lexsort((cost, -saved))  # by saved descending, then cost ascending
    keep, best = [], np.inf
    for i in order:  # walking down in saved, keep points strictly cheaper than all above
        if cost[i] < best:
            best = cost[i]
            keep.append(i)
    keep = keep[::-1]
    return saved[keep], cost[keep], [combos[i] for i in keep]


class SegmentFrontier:
    """Cheapest recompute for every segment [lo, hi) of the units, for any in-flight count."""

    def __init__(self, costs: LayerCosts):
        self.costs = costs
        u = len(costs)
        self.units = u
        act = np.asarray(costs.activation_mib, np.float64)
        static = np.asarray(costs.static_mib, np.float64)
        ca, cs = np.concatenate([[0.0], np.cumsum(act)]), np.concatenate([[0.0], np.cumsum(static)])
        self.act_full = ca[None, :] - ca[:, None]  # [lo, hi]
        self.static = cs[None, :] - cs[:, None]
        self.act_full[0, :] += float(costs.first.activation_mib)
        self.static[0, :] += costs.first.static_mib
        self.act_full[:, u] += float(costs.last.activation_mib)
        self.static[:, u] += costs.last.static_mib
        fwd = np.concatenate([[0.0], np.cumsum(costs.forward_ms)])
        bwd = np.concatenate([[0.0], np.cumsum(costs.backward_ms)])
        self.base_time = (fwd[None, :] - fwd[:, None]) + (bwd[None, :] - bwd[:, None])
        self.base_time[0, :] += float(costs.first.forward_ms) + float(costs.first.backward_ms)
        self.base_time[:, u] += float(costs.last.forward_ms) + float(costs.last.backward_ms)
        self.fronts: dict[tuple[int, int], tuple] = {}
        lo_idx, hi_idx = np.triu_indices(u + 1, 1)
        self.lo, self.hi = lo_idx, hi_idx
        lengths, saved_rows, cost_rows = [], [], []
        cache: dict[bytes, tuple] = {}
        for lo, hi in zip(lo_idx.tolist(), hi_idx.tolist(), strict=True):
            prefixes = _group_prefixes(costs, lo, hi)
            key = b"".join(np.asarray(x).tobytes() + b"|" for p in prefixes for x in p)
            if key not in cache:
                cache[key] = (_frontier(prefixes), [g for g, _, _ in prefixes])
            (saved, cost, combos), groups = cache[key]
            self.fronts[(lo, hi)] = (saved, cost, combos, groups)
            lengths.append(len(saved))
            saved_rows.append(saved)
            cost_rows.append(cost)
        width = max(lengths)
        self.saved = np.full((len(lengths), width), np.inf)
        self.cost = np.full((len(lengths), width), np.inf)
        for i, (s, c) in enumerate(zip(saved_rows, cost_rows, strict=True)):
            self.saved[i, :len(s)] = s
            self.cost[i, :len(c)] = c
        self._times: dict[tuple[int, float], np.ndarray] = {}

    def stage_times(self, inflight: int, budget_mib: float) -> np.ndarray:
        """(U+1, U+1) matrix: least fwd+bwd+recompute ms of segment [lo, hi), inf if none fits."""
        key = (inflight, budget_mib)
        if key not in self._times:
            need = self.act_full[self.lo, self.hi] - (budget_mib - self.static[self.lo, self.hi]) \
                / inflight
            idx = (self.saved < need[:, None] - 1e-9).sum(axis=1)
            padded = np.concatenate([self.cost, np.full((len(idx), 1), np.inf)], axis=1)
            rec = padded[np.arange(len(idx)), idx]
            out = np.full((self.units + 1, self.units + 1), np.inf)
            out[self.lo, self.hi] = self.base_time[self.lo, self.hi] + rec
            self._times[key] = out
        return self._times[key]

    def choice(self, lo: int, hi: int, inflight: int, budget_mib: float) -> dict[int, int] | None:
        """The recompute counts per group behind `stage_times` for one segment (None: no fit)."""
        saved, cost, combos, groups = self.fronts[(lo, hi)]
        need = self.act_full[lo, hi] - (budget_mib - self.static[lo, hi]) / inflight
        i = int((saved < need - 1e-9).sum())
        if i == len(saved):
            return None
        return dict(zip(groups, combos[i], strict=True))

    def min_memory_mib(self, inflight: int) -> np.ndarray:
        """(U+1, U+1): memory of each segment with everything recomputable recomputed."""
        most = np.full((self.units + 1, self.units + 1), np.inf)
        most[self.lo, self.hi] = self.saved.max(axis=1, where=np.isfinite(self.saved),
                                                initial=0.0)
        out = self.static + inflight * (self.act_full - most)
        out[~np.isfinite(most)] = np.inf
        return out


def cheapest_recompute(costs: LayerCosts, lo: int, hi: int, inflight: int,
                       budget_mib: float) -> tuple[dict[int, int], float] | None:
    """Reference by enumeration: the least-time counts that fit, and that stage time (ms)."""
    groups = sorted({int(g) for g in costs.group[lo:hi] if g >= 0})
    sizes = [int(np.sum(costs.group[lo:hi] == g)) for g in groups]
    best = None
    for combo in itertools.product(*[range(n + 1) for n in sizes]):
        counts = dict(zip(groups, combo, strict=True))
        if stage_memory_mib(costs, lo, hi, counts, inflight) <= budget_mib + 1e-6:
            t = sum(stage_time_ms(costs, lo, hi, counts))
            if best is None or t < best[1] - 1e-12:
                best = (counts, t)
    return best
