"""Per-stage memory: static state plus the activations of the micro-batches in flight.

Under 1F1B, stage s of P runs min(P - s, m) forwards before its first backward, so it holds that
many micro-batches' activations at its peak: stage 0 holds the most, the last stage one. That
asymmetry is why recomputation should differ per stage.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from megatron_omnibal.planner.simulator.simulate import order_1f1b, order_interleaved

if TYPE_CHECKING:  # costs.py prices static memory with static_bytes_per_param
    from megatron_omnibal.planner.cost_model.costs import LayerCosts

GIB_MIB = 1024.0


def static_bytes_per_param(dp: int = 1) -> float:
    """Static bytes one parameter costs a GPU: its BF16 weight, FP32 main gradient and FP32 Adam
    state (12 bytes), the last sharded over `dp` ranks by the distributed optimizer."""
    return 2 + 4 + 12 / dp


def inflight_1f1b(stage: int, pp: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak under 1F1B."""
    return min(pp - stage, micro_batches)


@functools.lru_cache(maxsize=1024)
def inflight_states(
    rank: int, pp: int, vpp: int, micro_batches: int
) -> tuple[tuple[int, ...], ...]:
    """Per-chunk micro-batches whose activations `rank` holds, at each possible peak.

    Replays Megatron's order for the rank (1F1B, or interleaved with `vpp` chunks): a forward
    of chunk c stores one more micro-batch of chunk c, its backward frees it. The peaks are the
    states right after a forward; only those no other state holds at least as much of every
    chunk are kept. The rank's peak memory is its chunks' static state plus the largest, over
    these states, of the sum of live micro-batches x stored activations per chunk. Under 1F1B
    that is the one state (min(pp - rank, m),); interleaved, rank 0 of pp 4, vpp 2, m 8 peaks
    at (7, 4) and (8, 3): the sum, 11, is Megatron's warm-up of (pp - rank - 1) x 2 +
    (vpp - 1) x pp forwards plus one, and the chunks' split of it moves during the steady state.
    """
    order = (
        order_1f1b(rank, pp, micro_batches)
        if vpp == 1
        else order_interleaved(rank, pp, vpp, micro_batches)
    )
    live = [0] * vpp
    states = set()
    for kind, chunk, _ in order:
        live[chunk] += 1 if kind == "F" else -1
        if kind == "F":
            states.add(tuple(live))
    return tuple(
        sorted(
            s
            for s in states
            if not any(o != s and all(a >= b for a, b in zip(o, s, strict=True)) for o in states)
        )
    )


def inflight_interleaved(rank: int, pp: int, vpp: int, micro_batches: int) -> int:
    """Model-chunk micro-batches held at the peak by `rank` under interleaved 1F1B.

    Megatron runs (pp - rank - 1) * 2 + (vpp - 1) * pp warm-up forwards, then one more before
    the first backward frees anything.
    """
    if vpp == 1:
        return inflight_1f1b(rank, pp, micro_batches)
    total = micro_batches * vpp
    return min((pp - rank - 1) * 2 + (vpp - 1) * pp + 1, total)


def recompute_mask(costs: LayerCosts, lo: int, hi: int, counts: dict[int, int]) -> np.ndarray:
    """Boolean (hi - lo,): the first counts[g] units of each recompute group g in [lo, hi)."""
    group = np.asarray(costs.group[lo:hi])
    mask = np.zeros(hi - lo, bool)
    for g, k in counts.items():
        idx = np.flatnonzero(group == g)
        if k > len(idx) or k < 0:
            raise ValueError(f"cannot recompute {k} layers of group {g}: the stage has {len(idx)}")
        mask[idx[:k]] = True
    return mask


def stage_memory_mib(
    costs: LayerCosts, lo: int, hi: int, counts: dict[int, int], inflight: int
) -> float:
    """Peak memory (MiB) of a stage holding units [lo, hi) with `counts` layers recomputed.

    Static state, plus `inflight` micro-batches of stored activations: full activations of
    kept layers, inputs (checkpoints) of recomputed ones, what the stage receives beside the
    hidden state (DeepStack features in flight), plus pinned first/last-stage work.
    """
    mask = recompute_mask(costs, lo, hi, counts)
    act = np.asarray(costs.activation_mib[lo:hi], np.float64)
    ckpt = np.asarray(costs.checkpoint_mib[lo:hi], np.float64)
    stored = float(np.where(mask, ckpt, act).sum()) + float(costs.inbound_at(lo))
    static = float(np.sum(costs.static_mib[lo:hi]))
    if lo == 0:
        stored += float(costs.first.activation_mib)
        static += costs.first.static_mib
    if hi == len(costs):
        stored += float(costs.last.activation_mib)
        static += costs.last.static_mib
    return static + inflight * stored


def stage_time_ms(
    costs: LayerCosts, lo: int, hi: int, counts: dict[int, int]
) -> tuple[float, float]:
    """(forward, backward including recompute) ms of a stage for one micro-batch."""
    mask = recompute_mask(costs, lo, hi, counts)
    fwd = float(np.sum(costs.forward_ms[lo:hi]))
    bwd = float(np.sum(costs.backward_ms[lo:hi])) + float(np.sum(costs.recompute_ms[lo:hi][mask]))
    if lo == 0:
        fwd += float(costs.first.forward_ms)
        bwd += float(costs.first.backward_ms)
    if hi == len(costs):
        fwd += float(costs.last.forward_ms)
        bwd += float(costs.last.backward_ms)
    return fwd, bwd
