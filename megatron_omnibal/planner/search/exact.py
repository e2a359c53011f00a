"""Certified-optimal partition search under the exact pipeline simulation (branch and bound).

With identical micro-batches, a 1F1B or interleaved 1F1B step is the longest path through a
fixed graph of operations (Megatron's per-rank order plus the cross-stage dependencies); only
the durations depend on the partition. Stages here are virtual stages (chunk c of rank r is
stage c x pp + r; with vpp 1 the ranks). Any path through that graph visits each stage some
number of times
(nF forwards, nB backwards, nC transfers across the boundary after it), so its length is a sum
over stages of nF f_s + nB b_s + nC p2p_s: additive in the partition, and a lower bound on the
step of EVERY partition. A set of such path "signatures" gives a lower bound per partition
(the max over signatures) and, through a suffix DP per signature, a lower bound for every
completion of a partial partition.

`certify` runs best-first search over partial partitions (stages cut left to right) ordered by
that bound; full partitions are simulated exactly (vectorised longest path), and each simulated
partition's critical path joins the signature set (cutting planes), tightening the bound where
it was loose. It stops when the best simulated step is within `tolerance` of the least bound
left open, so the result is provably within `tolerance` of the true optimum.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from megatron_omnibal.planner.simulator.simulate import order_1f1b, order_interleaved


@dataclass(frozen=True)
class PipelineGraph:
    """The operation graph of (pp, vpp, m) in a topological order, over `stages` = pp x vpp
    virtual stages.

    Per operation: its virtual stage, kind (0 forward, 1 backward), the previous operation on
    its rank (-1: none), its cross-stage input (-1: none) and the boundary that input crosses
    (-1: none).
    """

    stages: int
    m: int
    stage: np.ndarray
    kind: np.ndarray
    prev: np.ndarray
    dep: np.ndarray
    cross: np.ndarray


@functools.lru_cache(maxsize=64)
def pipeline_graph(pp: int, m: int, vpp: int = 1) -> PipelineGraph:
    """Build the graph by replaying Megatron's order until every operation is placed."""
    nv = pp * vpp
    orders = [
        order_1f1b(r, pp, m) if vpp == 1 else order_interleaved(r, pp, vpp, m) for r in range(pp)
    ]
    index: dict[tuple[int, str, int], int] = {}
    stage, kind, prev, dep, cross = [], [], [], [], []
    pos = [0] * pp
    last = [-1] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                k, chunk, j = orders[r][pos[r]]
                v = chunk * pp + r
                if k == "F":
                    src, bnd = ((v - 1, "F", j), v - 1) if v > 0 else (None, -1)
                elif v == nv - 1:
                    src, bnd = None, -1  # its own forward, earlier on the same rank
                else:
                    src, bnd = (v + 1, "B", j), v
                if src is not None and src not in index:
                    break
                index[(v, k, j)] = len(stage)
                stage.append(v)
                kind.append(0 if k == "F" else 1)
                prev.append(last[r])
                dep.append(index[src] if src is not None else -1)
                cross.append(bnd)
                last[r] = index[(v, k, j)]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline order deadlocked")
    arr = functools.partial(np.asarray, dtype=np.int64)
    return PipelineGraph(nv, m, arr(stage), arr(kind), arr(prev), arr(dep), arr(cross))


@dataclass(frozen=True)
class Signature:
    """A path's visits per stage: forwards, backwards, crossings of the boundary after it."""

    forwards: tuple[int, ...]
    backwards: tuple[int, ...]
    crossings: tuple[int, ...]  # (pp,), the last always 0


def longest_paths(
    graph: PipelineGraph,
    forward_ms: np.ndarray,
    backward_ms: np.ndarray,
    p2p_ms: np.ndarray,
    paths: bool = False,
) -> tuple[np.ndarray, list[Signature]]:
    """Step time of n partitions at once ((n, pp) stage times, (n, pp - 1) transfer times).

    Equal to `simulate(...).makespan_ms` with identical micro-batches. With `paths`, also each
    partition's critical path as a Signature.
    """
    fwd = np.asarray(forward_ms, np.float64)
    n, pp = fwd.shape
    dur = np.stack([fwd.T, np.asarray(backward_ms, np.float64).T])  # (2, pp, n)
    link = np.zeros((pp, n))
    link[: pp - 1] = np.asarray(p2p_ms, np.float64).reshape(n, pp - 1).T
    ops = len(graph.stage)
    end = np.empty((ops, n))
    via_dep = np.zeros((ops, n), bool)
    zero = np.zeros(n)
    for i, (s, k, p, d, c) in enumerate(
        zip(
            graph.stage.tolist(),
            graph.kind.tolist(),
            graph.prev.tolist(),
            graph.dep.tolist(),
            graph.cross.tolist(),
            strict=True,
        )
    ):
        start = end[p] if p >= 0 else zero
        if d >= 0:
            ready = end[d] + link[c] if c >= 0 else end[d]
            via_dep[i] = ready > start
            start = np.maximum(start, ready)
        end[i] = start + dur[k, s]
    last = end.argmax(axis=0)
    span = end[last, np.arange(n)]
    sigs = [_backtrack(graph, via_dep[:, col], int(last[col])) for col in range(n)] if paths else []
    return span, sigs


def partition_steps(
    forward: np.ndarray,
    backward: list[np.ndarray],
    p2p: np.ndarray,
    m: int,
    parts: list[tuple[int, ...]],
    paths: bool = False,
    vpp: int = 1,
) -> tuple[np.ndarray, list[Signature]]:
    """Exact steps of many partitions (boundary tuples over pp x vpp virtual stages) from the
    segment tables of `certify` (inf where a stage cannot fit)."""
    b = np.array(parts)
    nv = b.shape[1] - 1
    f = np.stack([forward[b[:, s], b[:, s + 1]] for s in range(nv)], axis=1)
    bw = np.stack([backward[s][b[:, s], b[:, s + 1]] for s in range(nv)], axis=1)
    graph = pipeline_graph(nv // vpp, m, vpp)
    return longest_paths(graph, f, bw, np.asarray(p2p)[b[:, 1:-1]], paths=paths)


def _backtrack(graph: PipelineGraph, via_dep: np.ndarray, op: int) -> Signature:
    pp = graph.stages
    nf, nb, nc = [0] * pp, [0] * pp, [0] * pp
    while op >= 0:
        s = int(graph.stage[op])
        (nb if graph.kind[op] else nf)[s] += 1
        if via_dep[op]:
            c = int(graph.cross[op])
            if c >= 0:
                nc[c] += 1
            op = int(graph.dep[op])
        else:
            op = int(graph.prev[op])
    return Signature(tuple(nf), tuple(nb), tuple(nc))


def single_path_signature(stages: int) -> Signature:
    """Micro-batch 0 forward through every stage and its gradient back: a path of every
    schedule, whose value over the first s stages is the work before stage s."""
    return Signature((1,) * stages, (1,) * stages, (2,) * (stages - 1) + (0,))


def rank_signatures(graph: PipelineGraph, pp: int) -> list[Signature]:
    """Per rank, a critical path through all of its operations (the interleaved schedule's
    bottleneck paths): the longest path when only that rank's stages take time."""
    nv = graph.stages
    rank = np.arange(nv) % pp
    times = (rank[None, :] == np.arange(pp)[:, None]) + 1e-6
    _, sigs = longest_paths(graph, times, times, np.zeros((pp, nv - 1)), paths=True)
    return list(dict.fromkeys(sigs))


def bottleneck_signatures(pp: int, m: int) -> list[Signature]:
    """Micro-batch 0 down to stage k, all of stage k's work, the last gradient back up."""
    out = []
    for k in range(pp):
        nf = tuple(1 if s < k else m if s == k else 0 for s in range(pp))
        nc = tuple(2 if s < k else 0 for s in range(pp))
        out.append(Signature(nf, nf, nc))
    return out


def fill_drain_signatures(pp: int, m: int) -> list[Signature]:
    """With m < pp, stages r <= pp - m run all their forwards before any backward (warm-up
    min(pp - r - 1, m) >= m - 1), so a path may take micro-batch 0 down to stage k, all m
    forwards there, micro-batch m - 1 on down to r = pp - m, turn to micro-batch 0's gradient
    there, up to stage j, all m backwards there, and the last gradient up: the sum over
    stages <= r of f + b plus (m - 1)(f_k + b_j), for every k, j <= r."""
    r = pp - m
    if r < 0 or m < 2:
        return []
    out = []
    for k, j in itertools.product(range(r + 1), repeat=2):
        nf = tuple(1 + (m - 1) * (s == k) if s <= r else 0 for s in range(pp))
        nb = tuple(1 + (m - 1) * (s == j) if s <= r else 0 for s in range(pp))
        nc = tuple(2 if s < r else 0 for s in range(pp))
        out.append(Signature(nf, nb, nc))
    return out


def sampled_signatures(
    graph: PipelineGraph,
    forward_ms: np.ndarray,
    backward_ms: np.ndarray,
    p2p_ms: np.ndarray,
    samples: int = 256,
    seed: int = 0,
) -> list[Signature]:
    """Critical paths of the graph under stage times scattered around the given ones.

    Every critical path is a path of the graph, whatever the times that made it critical, so
    each is a valid plane for every partition; times near a good partition's find the paths
    that bind near the optimum before the search has to simulate its way to them.
    """
    rng = np.random.default_rng(seed)
    noise = np.exp(rng.normal(0.0, 0.3, (2, samples, graph.stages)))
    _, sigs = longest_paths(
        graph,
        forward_ms[None, :] * noise[0],
        backward_ms[None, :] * noise[1],
        np.repeat(np.asarray(p2p_ms, np.float64)[None, :], samples, axis=0),
        paths=True,
    )
    return list(dict.fromkeys(sigs))


@dataclass
class Certificate:
    """Outcome of `certify`: the best partition, its step and a bound on every partition."""

    bounds: tuple[int, ...]
    step_ms: float
    lower_bound_ms: float
    simulated: int
    expanded: int
    signatures: int
    complete: bool  # False: stopped at max_nodes; lower_bound_ms still holds


class _Bound:
    """Per-signature suffix minima over the units (the cutting-plane state).

    `x[s]` stacks, for every segment [lo, hi) as stage s, its forward ms, backward ms and the
    transfer after it, so a signature's stage value is one dot product with its 3 counts.
    """

    def __init__(
        self,
        forward: np.ndarray,
        backward: list[np.ndarray],
        p2p: np.ndarray,
        seeds: list[Signature],
    ):
        self.pp = pp = len(backward)
        self.units = u = forward.shape[0] - 1
        self.feasible = np.stack([np.isfinite(b) for b in backward])  # (pp, U+1, U+1)
        fwd = np.where(np.isfinite(forward), forward, 0.0)
        link = np.broadcast_to(np.asarray(p2p, np.float64)[None, :], (u + 1, u + 1))
        self.x = np.zeros((pp, 3, u + 1, u + 1))
        for s in range(pp):
            self.x[s, 0] = fwd
            self.x[s, 1] = np.where(self.feasible[s], backward[s], 0.0)
            if s < pp - 1:
                self.x[s, 2] = link
        self.coef = np.zeros((pp, 0, 3))  # per stage: (K, 3) counts of each signature
        self.suffix = np.zeros((0, pp + 1, u + 1))
        self.keys: set[Signature] = set()
        # head[s][lo, hi]: max over signatures pivoting at stage s of their least value from s
        # on, with stage s on [lo, hi); joint[s][lo]: least over completions from (s, lo) of
        # the max over signatures pivoting at s or later (see `_joint`)
        self.head = np.full((pp, u + 1, u + 1), -np.inf)
        self.add([single_path_signature(pp), *seeds])  # v[0]: the work before the next stage

    def _joint(self) -> np.ndarray:
        """(pp + 1, U + 1) lower bound on every completion from stage s at unit lo of the max
        over the signatures that pivot at s or later, counting only their value from s on.

        A signature's pivot is its first stage visited other than once each way (one forward,
        one backward, both transfers): before it, it counts exactly the work before the pivot,
        common to all of them, so the max over them is handled jointly by DP (each stage: the
        signatures pivoting there, against the stage's work plus the bound of the rest)
        instead of separately; past its pivot each signature is bounded by its own minimum.
        """
        out = np.full((self.pp + 1, self.units + 1), np.inf)
        out[self.pp, self.units] = 0.0
        for s in range(self.pp - 1, -1, -1):
            x = self.x[s]
            t = np.where(self.feasible[s], x[0] + x[1], np.inf)
            rest = t + 2 * x[2] + out[s + 1][None, :]
            out[s] = np.min(np.maximum(self.head[s], rest), axis=1)
        return out

    def node_bound(self, v: np.ndarray, s: int, lo) -> np.ndarray:
        """Lower bound on every completion of prefixes with signature values v (K, n) that
        have cut s stages and end at units lo (n,)."""
        sep = np.max(v + self.suffix[:, s, lo], axis=0)
        if s == self.pp:
            return sep
        return np.maximum(sep, v[0] + self.joint[s, lo])

    def children(self, s: int, lo: int, his: np.ndarray) -> np.ndarray:
        """(K, len(his)) values of every signature for stage s on [lo, hi), inf if no fit."""
        val = self.coef[s] @ self.x[s][:, lo, his]
        return np.where(self.feasible[s, lo, his], val, np.inf)

    def add(self, sigs: list[Signature]) -> int:
        new = [g for g in dict.fromkeys(sigs) if g not in self.keys]
        if not new:
            return 0
        self.keys.update(new)
        coef = np.array([[g.forwards, g.backwards, g.crossings] for g in new], np.float64)
        coef = coef.transpose(2, 0, 1)  # (pp, K, 3)
        suffix = np.full((len(new), self.pp + 1, self.units + 1), np.inf)
        suffix[:, self.pp, self.units] = 0.0
        once = np.array([1.0, 1.0, 2.0])
        other = np.any(coef != once, axis=2)  # (pp, K): stage not visited once each way
        other[-1] = True  # a signature visiting every stage once pivots at the last
        pivot = np.argmax(other, axis=0)
        for s in range(self.pp - 1, -1, -1):
            val = np.einsum("kc,cij->kij", coef[s], self.x[s])
            val[:, ~self.feasible[s]] = np.inf
            tot = val + suffix[:, s + 1, None, :]
            suffix[:, s] = np.min(tot, axis=2)
            if np.any(pivot == s):
                self.head[s] = np.maximum(self.head[s], tot[pivot == s].max(axis=0))
        self.coef = np.concatenate([self.coef, coef], axis=1)
        self.suffix = np.concatenate([self.suffix, suffix])
        self.joint = self._joint()
        return len(new)

    def prefix(self, bounds: tuple[int, ...], start: int = 0) -> np.ndarray:
        """Values of signatures start.. summed over the stages cut so far."""
        n = len(bounds) - 1
        x = self.x[np.arange(n), :, bounds[:-1], bounds[1:]]  # (n, 3)
        return np.einsum("skc,sc->k", self.coef[:n, start:], x)


def certify(
    forward: np.ndarray,
    backward: list[np.ndarray],
    p2p: np.ndarray,
    m: int,
    incumbent: tuple[int, ...],
    tolerance: float = 1e-3,
    max_nodes: int = 200_000,
    batch: int = 32,
    improve=None,
    dive_every: int = 500,
    vpp: int = 1,
    evaluate=None,
) -> Certificate:
    """Best partition under the exact pipeline step, provably within `tolerance` of the optimum.

    `forward` (U+1, U+1): forward ms of segment [lo, hi); `backward[s]`: backward (with the
    stage's cheapest fitting recompute) of that segment as (virtual) stage s, inf where it
    cannot fit; `p2p[b]`: one transfer across the boundary before unit b. `incumbent`: a good
    partition (from the fast DPs) whose step seeds the pruning threshold. `improve(bounds,
    step) -> (bounds, step)`, if given, is a local search run on every new best split (a lower
    threshold sooner prunes more). Every `dive_every` expansions, a greedy dive from the
    current node (least-bound child down to a full split) looks for a better split.
    `evaluate(parts) -> (steps, signatures)`, if given, times full splits instead of the tables
    (the tables then only need to bound every split's stage times from below, as the
    interleaved search's do: a rank's chunks share its memory).
    """
    search = _Search(forward, backward, p2p, m, vpp, tolerance, improve, evaluate)
    search.start(incumbent)
    while search.heap:
        if search.heap[0][0] >= search.threshold() or search.expanded >= max_nodes:
            break
        search.visit(batch, dive_every)
    return search.certificate()


class _Search:
    """certify's branch and bound: the best split so far, the splits simulated, the open
    partial splits (a heap by lower bound) and the least bound of those dropped for being
    within tolerance."""

    def __init__(
        self,
        forward: np.ndarray,
        backward: list[np.ndarray],
        p2p: np.ndarray,
        m: int,
        vpp: int,
        tolerance: float,
        improve,
        evaluate,
    ) -> None:
        self.forward, self.backward, self.p2p, self.m, self.vpp = forward, backward, p2p, m, vpp
        self.tolerance, self.improve, self.evaluate = tolerance, improve, evaluate
        self.nv, self.units = len(backward), forward.shape[0] - 1
        self.pp = self.nv // vpp
        self.graph = pipeline_graph(self.pp, m, vpp)
        seeds = (
            bottleneck_signatures(self.pp, m) if vpp == 1 else rank_signatures(self.graph, self.pp)
        )
        self.bound = _Bound(forward, backward, p2p, seeds)
        self.best: tuple[int, ...] = ()
        self.best_step = np.inf
        self.simulated: set[tuple[int, ...]] = set()
        self.expanded = 0
        self.counter = itertools.count()
        self.heap: list = []
        self.floor = np.inf  # least bound among nodes dropped for being within tolerance

    def start(self, incumbent: tuple[int, ...]) -> None:
        """Seed the threshold with the incumbent's step and the bound with its signatures."""
        spans, sigs = self._run([incumbent])
        self.best, self.best_step = incumbent, float(spans[0])
        sigs += self._around(incumbent)
        self.bound.add((fill_drain_signatures(self.pp, self.m) if self.vpp == 1 else []) + sigs)
        self.simulated = {incumbent}
        self.heap = [(0.0, next(self.counter), (0,), np.zeros(self.bound.coef.shape[1]))]

    def threshold(self) -> float:
        return self.best_step / (1.0 + self.tolerance)

    def visit(self, batch: int, dive_every: int) -> None:
        """Pop the least-bound node: re-bound it, simulate it (a full split) or expand it."""
        lb, _, prefix, v = heapq.heappop(self.heap)
        if len(v) < self.bound.coef.shape[1]:  # signatures added since the push
            v = self._rebound(lb, prefix, v)
            if v is None:
                return
        if len(prefix) - 1 == self.nv:
            self._simulate_leaves(prefix, batch)
        else:
            self._expand(prefix, v, dive_every)

    def certificate(self) -> Certificate:
        complete = not self.heap or self.heap[0][0] >= self.threshold()
        open_lb = self.heap[0][0] if self.heap else np.inf
        lower = min(self.best_step, self.floor, open_lb)
        return Certificate(
            self.best,
            self.best_step,
            lower,
            len(self.simulated),
            self.expanded,
            self.bound.coef.shape[1],
            complete,
        )

    def _run(self, parts: list[tuple[int, ...]]) -> tuple[np.ndarray, list[Signature]]:
        if self.evaluate is not None:
            return self.evaluate(parts)
        return partition_steps(
            self.forward, self.backward, self.p2p, self.m, parts, paths=True, vpp=self.vpp
        )

    def _around(self, part: tuple[int, ...]) -> list[Signature]:
        rows = range(self.nv)
        return sampled_signatures(
            self.graph,
            np.array([self.forward[part[s], part[s + 1]] for s in rows]),
            np.array([self.backward[s][part[s], part[s + 1]] for s in rows]),
            np.asarray(self.p2p, np.float64)[list(part[1:-1])],
        )

    def _simulate(self, parts: list[tuple[int, ...]]) -> None:
        """Simulate full splits: keep the best (locally improved), learn their signatures."""
        spans, sigs = self._run(parts)
        self.simulated.update(parts)
        i = int(np.argmin(spans))
        if spans[i] < self.best_step:
            self.best, self.best_step = parts[i], float(spans[i])
            if self.improve is not None:
                self.best, self.best_step = self.improve(self.best, self.best_step)
                self.simulated.add(self.best)
            sigs += self._around(self.best)
        self.bound.add(sigs)

    def _rebound(self, lb: float, prefix: tuple[int, ...], v: np.ndarray) -> np.ndarray | None:
        """Re-bound a node lazily with the signatures added since its push: its values over
        all signatures, or None when the bound rose (the node is pushed back or dropped)."""
        s, lo = len(prefix) - 1, prefix[-1]
        v = np.concatenate([v, self.bound.prefix(prefix, len(v))])
        fresh = float(self.bound.node_bound(v[:, None], s, np.array([lo]))[0])
        if fresh <= lb + 1e-12 * max(1.0, lb):
            return v
        if fresh < self.threshold():
            heapq.heappush(self.heap, (fresh, next(self.counter), prefix, v))
        else:
            self.floor = min(self.floor, fresh)
        return None

    def _simulate_leaves(self, prefix: tuple[int, ...], batch: int) -> None:
        """A full partition: simulate it with up to `batch` other full ones on top."""
        leaves = [prefix]
        heap = self.heap
        while heap and len(leaves) < batch and len(heap[0][2]) == self.nv + 1:
            if heap[0][0] >= self.threshold():
                break
            leaves.append(heapq.heappop(heap)[2])
        todo = [p for p in leaves if p not in self.simulated]
        if todo:
            self._simulate(todo)

    def _expand(self, prefix: tuple[int, ...], v: np.ndarray, dive_every: int) -> None:
        """Push the children of a partial split whose bound stays under the threshold."""
        s, lo = len(prefix) - 1, prefix[-1]
        self.expanded += 1
        if self.expanded % dive_every == 0:  # primal heuristic: a greedy dive to a full split
            leaf = _dive(self.bound, prefix, v, self.units)
            if leaf is not None and leaf not in self.simulated:
                self._simulate([leaf])
                v = np.concatenate([v, self.bound.prefix(prefix, len(v))])
        units, nv = self.units, self.nv
        his = np.arange(units, units + 1) if s == nv - 1 else np.arange(lo + 1, units - nv + s + 2)
        child = v[:, None] + self.bound.children(s, lo, his)
        lbs = self.bound.node_bound(child, s + 1, his)
        keep = lbs < self.threshold()
        if np.any(~keep):
            self.floor = min(self.floor, float(lbs[~keep].min()))
        for j in np.flatnonzero(keep):
            heapq.heappush(
                self.heap, (float(lbs[j]), next(self.counter), (*prefix, int(his[j])), child[:, j])
            )


def _dive(bound: _Bound, prefix: tuple[int, ...], v: np.ndarray, units: int):
    """Follow the least-bound child from a partial split down to a full one (None: dead end)."""
    pp = bound.pp
    while len(prefix) <= pp:
        s, lo = len(prefix) - 1, prefix[-1]
        his = np.arange(units, units + 1) if s == pp - 1 else np.arange(lo + 1, units - pp + s + 2)
        child = v[:, None] + bound.children(s, lo, his)
        lbs = bound.node_bound(child, s + 1, his)
        j = int(np.argmin(lbs))
        if not np.isfinite(lbs[j]):
            return None
        prefix, v = (*prefix, int(his[j])), child[:, j]
    return prefix
