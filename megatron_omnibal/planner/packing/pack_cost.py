"""The balancer's PackCost from the planner's cost model: what a tile, a token and a squared
token cost on each pipeline stage (forward + backward, plus the recompute of the layers the
stage recomputes), so that the balancer evens out modeled time rather than counts.

The planner's costs are linear in a micro-batch's (tiles, tokens, sum of squared sample
lengths, 1); the constant column is the same for every pack and is left out.
"""

from __future__ import annotations

import itertools

import numpy as np

from megatron_omnibal.balance.config import PackCost
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.cost_model.costs import CostModel, analytic_costs
from megatron_omnibal.planner.cost_model.hardware import Hardware


def stage_coefficients(cost_model: CostModel, bounds: tuple[int, ...],
                       recompute: list[dict[int, int]] | None = None) -> np.ndarray:
    """(stages, 4) ms per (tile, token, squared token, micro-batch) of fwd + bwd (+ recompute)
    of the units [bounds[s], bounds[s+1]) with recompute[s] layers recomputed per group."""
    units = len(cost_model.names)
    if bounds[0] != 0 or bounds[-1] != units or any(a >= b for a, b in
                                                     itertools.pairwise(bounds)):
        raise ValueError(f"pack cost: stage bounds {bounds} do not cut the {units} units")
    group = np.asarray(cost_model.group)
    rows = []
    for s, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        row = cost_model.forward[lo:hi].sum(axis=0) + cost_model.backward[lo:hi].sum(axis=0)
        for g, k in (recompute[s] if recompute else {}).items():
            idx = lo + np.flatnonzero(group[lo:hi] == g)[:k]
            row = row + cost_model.recompute[idx].sum(axis=0)
        if lo == 0:
            row = row + cost_model.first[0] + cost_model.first[1]
        if hi == units:
            row = row + cost_model.last[0] + cost_model.last[1]
        rows.append(row)
    return np.array(rows)


def pack_cost(cost_model: CostModel, bounds: tuple[int, ...] | None = None,
              recompute: list[dict[int, int]] | None = None) -> PackCost:
    """PackCost with one entry per stage of `bounds` (default: the whole model as one stage,
    nothing recomputed)."""
    bounds = (0, len(cost_model.names)) if bounds is None else tuple(bounds)
    c = stage_coefficients(cost_model, bounds, recompute)
    return PackCost(tile_ms=tuple(c[:, 0]), token_ms=tuple(c[:, 1]),
                    attention_ms=tuple(c[:, 2]))


def model_pack_cost(model: ModelSpec, hw: Hardware, tp: int = 1, dp: int = 1,
                    bounds: tuple[int, ...] | None = None,
                    recompute: list[dict[int, int]] | None = None,
                    image_tiles: np.ndarray | None = None) -> PackCost:
    """pack_cost of the analytic (FLOPs) cost model of `model` on `hw` (`image_tiles`: the
    data's tiles per image, for a native-resolution ViT's attention)."""
    return pack_cost(analytic_costs(model, hw, tp, dp, image_tiles=image_tiles), bounds,
                     recompute)
