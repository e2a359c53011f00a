"""Event-driven pipeline simulator: 1F1B and interleaved 1F1B, per micro-batch and per stage.

Each rank runs its operations in Megatron's order; an operation starts when its rank is free
and its input has arrived (the previous virtual stage's output plus point-to-point time). With
per-micro-batch times, data variability shows up as bubbles. Data-parallel replicas are
simulated one by one; the slowest gates the step, then gradients are synchronised.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Op:
    """One forward or backward of one micro-batch on one virtual stage."""

    rank: int
    chunk: int
    micro_batch: int
    kind: str  # "F" or "B"
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """A simulated pipeline step of one data-parallel replica."""

    ops: tuple[Op, ...]
    makespan_ms: float
    busy_ms: np.ndarray  # per rank
    pp: int
    vpp: int

    @property
    def idle_ms(self) -> np.ndarray:
        return self.makespan_ms - self.busy_ms

    @property
    def bubble_fraction(self) -> float:
        return float(1.0 - self.busy_ms.sum() / (self.pp * self.makespan_ms))


@functools.lru_cache(maxsize=4096)
def order_1f1b(rank: int, pp: int, m: int) -> tuple[tuple[str, int, int], ...]:
    """Megatron's non-interleaved 1F1B order for `rank`: (kind, chunk, micro-batch)."""
    warm = min(pp - rank - 1, m)
    ops = [("F", 0, j) for j in range(warm)]
    for i in range(m - warm):
        ops += [("F", 0, warm + i), ("B", 0, i)]
    ops += [("B", 0, j) for j in range(m - warm, m)]
    return tuple(ops)


@functools.lru_cache(maxsize=4096)
def order_interleaved(rank: int, pp: int, vpp: int, m: int) -> tuple[tuple[str, int, int], ...]:
    """Megatron's interleaved 1F1B order (needs m divisible by pp)."""
    total = m * vpp
    warm = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // pp) % vpp
        return (chunk if forward else vpp - 1 - chunk), (k // (pp * vpp)) * pp + k % pp

    ops = [("F", *unit(k, True)) for k in range(warm)]
    for i in range(total - warm):
        ops += [("F", *unit(warm + i, True)), ("B", *unit(i, False))]
    ops += [("B", *unit(k, False)) for k in range(total - warm, total)]
    return tuple(ops)


def simulate(
    forward_ms: np.ndarray,
    backward_ms: np.ndarray,
    pp: int,
    vpp: int = 1,
    p2p_ms: np.ndarray | float = 0.0,
    keep_ops: bool = True,
) -> Timeline:
    """Simulate one replica's step.

    `forward_ms`, `backward_ms`: (pp * vpp, m) per virtual stage (chunk c of rank r is virtual
    stage c * pp + r) and micro-batch; backward includes recompute. `p2p_ms`: scalar or
    (pp * vpp - 1, m), the transfer time from virtual stage v to v + 1 (and of its gradient
    back), charged only between different ranks. Without `keep_ops` (search loops), the
    timeline holds no operations, only makespan and busy time.
    """
    fwd = np.asarray(forward_ms, np.float64)
    bwd = np.asarray(backward_ms, np.float64)
    nv, m = fwd.shape
    if nv != pp * vpp or bwd.shape != fwd.shape:
        raise ValueError(
            f"simulate: times have shape {fwd.shape} / {bwd.shape}, expected "
            f"({pp * vpp}, m) for pp={pp}, vpp={vpp}"
        )
    if vpp > 1 and m % pp:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({m}) divisible by pp ({pp})")
    p2p = (
        np.broadcast_to(np.asarray(p2p_ms, np.float64), (max(nv - 1, 0), m))
        if nv > 1
        else np.zeros((0, m))
    )
    orders = [
        order_1f1b(r, pp, m) if vpp == 1 else order_interleaved(r, pp, vpp, m) for r in range(pp)
    ]
    fl, bl = fwd.tolist(), bwd.tolist()
    pl = (p2p if pp > 1 else np.zeros_like(p2p)).tolist()
    f_end: list[list[float | None]] = [[None] * m for _ in range(nv)]
    b_end: list[list[float | None]] = [[None] * m for _ in range(nv)]
    free = [0.0] * pp
    pos = [0] * pp
    ops: list[Op] = []
    last = 0.0
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            order, i, t_free = orders[r], pos[r], free[r]
            while i < len(order):
                kind, chunk, j = order[i]
                v = chunk * pp + r
                if kind == "F":
                    if v == 0:
                        ready = 0.0
                    else:
                        prev = f_end[v - 1][j]
                        if prev is None:
                            break
                        ready = prev + pl[v - 1][j]
                    end = max(t_free, ready) + fl[v][j]
                    f_end[v][j] = end
                else:
                    mine = f_end[v][j]
                    if v == nv - 1:
                        nxt = mine
                    else:
                        nxt = b_end[v + 1][j]
                        if nxt is not None:
                            nxt += pl[v][j]
                    if nxt is None or mine is None:
                        break
                    end = max(t_free, nxt, mine) + bl[v][j]
                    b_end[v][j] = end
                if keep_ops:
                    dur = fl[v][j] if kind == "F" else bl[v][j]
                    ops.append(Op(r, chunk, j, kind, end - dur, end))
                last = max(last, end)
                t_free = end
                i += 1
                remaining -= 1
                progressed = True
            pos[r], free[r] = i, t_free
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked (inconsistent operation order)")
    busy = np.array([fwd[r::pp].sum() + bwd[r::pp].sum() for r in range(pp)])
    return Timeline(tuple(ops), last, busy, pp, vpp)


@dataclass(frozen=True)
class StepResult:
    """A data-parallel step: the slowest replica's pipeline plus the gradient sync."""

    step_ms: float
    pipeline_ms: float
    sync_ms: float
    bubble_fraction: float
    busy_ms: np.ndarray
    idle_ms: np.ndarray
    slowest: Timeline
    replica_ms: np.ndarray


def simulate_step(
    replicas: list[tuple[np.ndarray, np.ndarray]],
    pp: int,
    vpp: int = 1,
    p2p_ms: np.ndarray | float | list = 0.0,
    sync_ms: float = 0.0,
) -> StepResult:
    """Simulate every replica (its own micro-batches); the slowest gates the gradient sync.

    `p2p_ms` may be one value/array for all replicas or a list with one per replica. Busy/idle
    and bubble are those of the slowest replica.
    """
    lines = []
    for i, (f, b) in enumerate(replicas):
        p = p2p_ms[i] if isinstance(p2p_ms, list) else p2p_ms
        lines.append(simulate(f, b, pp, vpp, p, keep_ops=False))
    spans = np.array([t.makespan_ms for t in lines])
    worst = lines[int(np.argmax(spans))]
    pipeline = float(spans.max())
    step = pipeline + sync_ms
    busy = worst.busy_ms
    return StepResult(
        step,
        pipeline,
        sync_ms,
        float(1 - busy.sum() / (pp * pipeline)),
        busy,
        pipeline - busy,
        worst,
        spans,
    )
