"""Per-stage memory: static state plus the activations of the micro-batches in flight.

Under 1F1B, stage s of P runs min(P - s, m) forwards before its first backward, so it holds that
many micro-batches' activations at its peak: stage 0 holds the most, the last stage one. That
asymmetry is why recomputation should differ per stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # costs.py prices static memory with static_bytes_per_param
    from megatron_omnibal.planner.costs import LayerCosts

GIB_MIB = 1024.0


def static_bytes_per_param(dp: int = 1) -> float:
    """Static bytes one parameter costs a GPU: its BF16 weight, FP32 main gradient and FP32 Adam
    state (12 bytes), the last sharded over `dp` ranks by the distributed optimizer."""
    return 2 + 4 + 12 / dp


def inflight_1f1b(stage: int, pp: int, micro_batches: int) -> int:
    """Micro-batches whose activations stage `stage` holds at its peak under 1F1B."""
    return min(pp - stage, micro_batches)


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
    kept layers, inputs (checkpoints) of recomputed ones, plus pinned first/last-stage work.
    """
    mask = recompute_mask(costs, lo, hi, counts)
    act = np.asarray(costs.activation_mib[lo:hi], np.float64)
    ckpt = np.asarray(costs.checkpoint_mib[lo:hi], np.float64)
    stored = float(np.where(mask, ckpt, act).sum())
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
