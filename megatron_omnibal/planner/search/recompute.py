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

from megatron_omnibal.planner.cost_model.costs import LayerCosts
from megatron_omnibal.planner.cost_model.memory import stage_memory_mib, stage_time_ms


def _group_prefixes(
    costs: LayerCosts, lo: int, hi: int
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Per recompute group in [lo, hi): (group, saved MiB prefix sums, recompute ms prefix)."""
    group = np.asarray(costs.group[lo:hi])
    saved = np.asarray(costs.activation_mib[lo:hi] - costs.checkpoint_mib[lo:hi], np.float64)
    rec = np.asarray(costs.recompute_ms[lo:hi], np.float64)
    out = []
    for g in np.unique(group[group >= 0]):
        idx = np.flatnonzero(group == g)
        out.append(
            (
                int(g),
                np.concatenate([[0.0], np.cumsum(saved[idx])]),
                np.concatenate([[0.0], np.cumsum(rec[idx])]),
            )
        )
    return out


def _frontier(prefixes: list) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]]]:
    """Pareto front over all count combinations: saved ascending, cheapest cost for >= saved.

    Ties in cost go to the option with fewer recomputed layers: with a recompute cost measured
    as 0, recomputing everything would otherwise "tie" with recomputing nothing and be chosen
    although memory does not need it.
    """
    if not prefixes:
        return np.zeros(1), np.zeros(1), [()]
    saved = np.zeros(1)
    cost = np.zeros(1)
    layers = np.zeros(1, np.int64)
    for _, s, c in prefixes:
        saved = (saved[:, None] + s[None, :]).ravel()
        cost = (cost[:, None] + c[None, :]).ravel()
        layers = (layers[:, None] + np.arange(len(s))[None, :]).ravel()
    # dense rank of (cost, layers): the lower, the better an answer for a given need
    by_key = np.lexsort((layers, cost))
    changed = (np.diff(cost[by_key]) != 0) | (np.diff(layers[by_key]) != 0)
    new_key = np.concatenate([[True], changed])
    rank = np.empty(len(cost), np.int64)
    rank[by_key] = np.cumsum(new_key)
    order = np.lexsort((rank, -saved))  # by saved descending, then best rank first
    sorted_rank = rank[order]
    best_above = np.concatenate([[np.iinfo(np.int64).max], np.minimum.accumulate(sorted_rank)[:-1]])
    keep = order[sorted_rank < best_above][::-1]  # points better than all saving more
    shape = tuple(len(s) for _, s, _ in prefixes)
    combos = list(zip(*(k.tolist() for k in np.unravel_index(keep, shape)), strict=True))
    return saved[keep], cost[keep], combos


def pareto_front(
    costs: LayerCosts, lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, ...]], list[int]]:
    """Segment [lo, hi)'s recompute options on the Pareto front (saved MiB per micro-batch
    ascending, recompute ms), their counts per group and the groups."""
    prefixes = _group_prefixes(costs, lo, hi)
    saved, cost, combos = _frontier(prefixes)
    return saved, cost, combos, [g for g, _, _ in prefixes]


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
        if costs.inbound_mib is not None:  # a stage starting at lo receives and holds these
            self.act_full[1:u, :] += np.asarray(costs.inbound_mib, np.float64)[1:, None]
        self.act_full[0, :] += float(costs.first.activation_mib)
        self.static[0, :] += costs.first.static_mib
        self.act_full[:, u] += float(costs.last.activation_mib)
        self.static[:, u] += costs.last.static_mib
        fwd = np.concatenate([[0.0], np.cumsum(costs.forward_ms)])
        bwd = np.concatenate([[0.0], np.cumsum(costs.backward_ms)])
        self.base_time = (fwd[None, :] - fwd[:, None]) + (bwd[None, :] - bwd[:, None])
        self.base_time[0, :] += float(costs.first.forward_ms) + float(costs.first.backward_ms)
        self.base_time[:, u] += float(costs.last.forward_ms) + float(costs.last.backward_ms)
        lo_idx, hi_idx = np.triu_indices(u + 1, 1)
        self.lo, self.hi = lo_idx, hi_idx
        group = np.asarray(costs.group)
        self.groups = [int(g) for g in np.unique(group[group >= 0])]
        self.count = {g: np.concatenate([[0], np.cumsum(group == g)]) for g in self.groups}
        # identical layers within each tower (the analytic model): closed-form queries
        self.uniform = len(self.groups) <= 2 and all(
            np.ptp(np.asarray(arr)[group == g]) == 0
            for g in self.groups
            for arr in (costs.activation_mib, costs.checkpoint_mib, costs.recompute_ms)
        )
        if self.uniform:
            first = {g: int(np.flatnonzero(group == g)[0]) for g in self.groups}
            self.unit_saved = {
                g: float(costs.activation_mib[i] - costs.checkpoint_mib[i])
                for g, i in first.items()
            }
            self.unit_cost = {g: float(costs.recompute_ms[i]) for g, i in first.items()}
            self.n = {g: (c[hi_idx] - c[lo_idx]) for g, c in self.count.items()}
        else:
            self._build_fronts()
        self._times: dict[tuple[int, float], np.ndarray] = {}

    def _build_fronts(self) -> None:
        """Pareto fronts per segment (general profiles: layers of a tower may differ)."""
        self.fronts: dict[tuple[int, int], tuple] = {}
        lengths, saved_rows, cost_rows = [], [], []
        for lo, hi in zip(self.lo.tolist(), self.hi.tolist(), strict=True):
            saved, cost, combos, groups = pareto_front(self.costs, lo, hi)
            self.fronts[(lo, hi)] = (saved, cost, combos, groups)
            lengths.append(len(saved))
            saved_rows.append(saved)
            cost_rows.append(cost)
        width = max(lengths)
        self.saved = np.full((len(lengths), width), np.inf)
        self.cost = np.full((len(lengths), width), np.inf)
        for i, (s, c) in enumerate(zip(saved_rows, cost_rows, strict=True)):
            self.saved[i, : len(s)] = s
            self.cost[i, : len(c)] = c

    def _need(self, inflight: int, budget_mib: float) -> np.ndarray:
        """Activation MiB per micro-batch each segment must save to fit."""
        return (
            self.act_full[self.lo, self.hi]
            - (budget_mib - self.static[self.lo, self.hi]) / inflight
        )

    def _uniform_query(
        self, need: np.ndarray, seg: np.ndarray | slice = slice(None)
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Least recompute ms for `need` (per segment), with the counts of the first and
        second group; inf where even everything recomputed saves too little."""
        need = need - 1e-9
        gs = self.groups
        if not gs:
            rec = np.where(need <= 0, 0.0, np.inf)
            zero = np.zeros(len(rec), int)
            return rec, zero, zero
        n0 = self.n[gs[0]][seg]
        s0, c0 = self.unit_saved[gs[0]], self.unit_cost[gs[0]]
        if len(gs) == 1:
            k0 = _count(need, s0)
            ok = k0 <= n0
            return np.where(ok, k0 * c0, np.inf), np.where(ok, k0, 0), np.zeros(len(k0), int)
        n1 = self.n[gs[1]][seg]
        s1, c1 = self.unit_saved[gs[1]], self.unit_cost[gs[1]]
        k0 = np.arange(int(n0.max()) + 1)[None, :]
        k1 = _count(need[:, None] - k0 * max(s0, 0.0), s1)
        ok = (k0 <= n0[:, None]) & (k1 <= n1[:, None])
        total = np.where(ok, k0 * c0 + k1 * c1, np.inf)
        best = np.lexsort((k0 + k1, total), axis=-1)[:, 0]  # ties: fewer recomputed layers
        rows = np.arange(len(best))
        return total[rows, best], best, k1[rows, best]

    def stage_times(self, inflight: int, budget_mib: float) -> np.ndarray:
        """(U+1, U+1) matrix: least fwd+bwd+recompute ms of segment [lo, hi), inf if none fits."""
        key = (inflight, budget_mib)
        if key not in self._times:
            need = self._need(inflight, budget_mib)
            if self.uniform:
                rec = self._uniform_query(need)[0]
            else:
                idx = (self.saved < need[:, None] - 1e-9).sum(axis=1)
                padded = np.concatenate([self.cost, np.full((len(idx), 1), np.inf)], axis=1)
                rec = padded[np.arange(len(idx)), idx]
            out = np.full((self.units + 1, self.units + 1), np.inf)
            out[self.lo, self.hi] = self.base_time[self.lo, self.hi] + rec
            self._times[key] = out
        return self._times[key]

    def choice(self, lo: int, hi: int, inflight: int, budget_mib: float) -> dict[int, int] | None:
        """The recompute counts per group behind `stage_times` for one segment (None: no fit)."""
        need = self.act_full[lo, hi] - (budget_mib - self.static[lo, hi]) / inflight
        if self.uniform:
            seg = np.array([int(np.flatnonzero((self.lo == lo) & (self.hi == hi))[0])])
            rec, k0, k1 = self._uniform_query(np.array([need]), seg)
            if not np.isfinite(rec[0]):
                return None
            present = [g for g in self.groups if self.n[g][seg[0]] > 0]
            counts = dict(zip(self.groups, (int(k0[0]), int(k1[0])), strict=False))
            return {g: counts[g] for g in present}
        saved, cost, combos, groups = self.fronts[(lo, hi)]
        i = int((saved < need - 1e-9).sum())
        if i == len(saved):
            return None
        return dict(zip(groups, combos[i], strict=True))

    def min_memory_mib(self, inflight: int) -> np.ndarray:
        """(U+1, U+1): memory of each segment with everything recomputable recomputed."""
        most = np.full((self.units + 1, self.units + 1), np.inf)
        if self.uniform:
            most[self.lo, self.hi] = (
                sum(np.maximum(self.unit_saved[g], 0.0) * self.n[g] for g in self.groups)
                if self.groups
                else 0.0
            )
        else:
            most[self.lo, self.hi] = self.saved.max(
                axis=1, where=np.isfinite(self.saved), initial=0.0
            )
        out = self.static + inflight * (self.act_full - most)
        out[~np.isfinite(most)] = np.inf
        return out


def _count(need: np.ndarray, per_layer: float) -> np.ndarray:
    """Layers needed to save `need` at `per_layer` each (0 if nothing is needed)."""
    need = np.asarray(need, np.float64)
    if per_layer <= 0:
        return np.where(need <= 0, 0, np.iinfo(np.int32).max)
    return np.maximum(np.ceil(need / per_layer), 0).astype(np.int64)


def cheapest_recompute(
    costs: LayerCosts, lo: int, hi: int, inflight: int, budget_mib: float
) -> tuple[dict[int, int], float] | None:
    """Reference by enumeration: the least-time counts that fit (ties: fewest recomputed
    layers), and that stage time (ms)."""
    groups = sorted({int(g) for g in costs.group[lo:hi] if g >= 0})
    sizes = [int(np.sum(costs.group[lo:hi] == g)) for g in groups]
    best = None
    for combo in itertools.product(*[range(n + 1) for n in sizes]):
        counts = dict(zip(groups, combo, strict=True))
        if stage_memory_mib(costs, lo, hi, counts, inflight) <= budget_mib + 1e-6:
            t = sum(stage_time_ms(costs, lo, hi, counts))
            if (
                best is None
                or t < best[1] - 1e-12
                or (t <= best[1] + 1e-12 and sum(combo) < sum(best[0].values()))
            ):
                best = (counts, t)
    return best
