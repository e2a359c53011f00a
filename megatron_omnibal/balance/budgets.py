"""Choosing the pack budgets (tiles, tokens) from the data.

A pack should hold about `samples_per_pack` samples, and its two budgets should match the data's
tokens per tile, so that neither runs out long before the other (a loose token budget, as in
OmniBal's (18, 6016) on InternVL data, leaves token balance to chance). A memory limit caps the
larger pack the GPU can hold; the budgets then shrink together.

One rule for `omnibal balance --auto-budget` and the planner (planner/search/setting.py), which
picks each micro-batch's budgets for its share of a replica's samples with 5% slack; the planner
keeps tokens from the data's mean (`tokens_follow_tiles=False`), as the plans it has made and
the training runs measured from them assume.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_omnibal.data.lengths import LengthStats

TOKEN_HEADROOM = 0.05   # token budget above tiles * tokens-per-tile: room to even out weight
TOKEN_ROUND = 64        # token budgets are multiples of this (kernel-friendly shapes)


def auto_budget(lengths: LengthStats, *, samples_per_pack: float = 4.0, slack: float = 1.0,
                tokens_follow_tiles: bool = True, max_vit_budget: int | None = None,
                max_token_budget: int | None = None) -> tuple[int, int]:
    """(vit_budget, token_budget) for about `samples_per_pack` samples per pack, times `slack`.

    The token budget follows the tile budget at the data's tokens per tile (plus
    TOKEN_HEADROOM), or with `tokens_follow_tiles=False` (or data without tiles) holds the mean
    sample's tokens as many times. Without limits both budgets hold the largest sample; limits
    below it leave such samples to the oversize policy of balance().
    """
    if len(lengths) == 0:
        raise ValueError("auto budget: no samples")
    if samples_per_pack <= 0:
        raise ValueError(f"auto budget: samples_per_pack must be > 0, got {samples_per_pack}")
    vit = lengths.vit.astype(np.float64)
    tok = lengths.tokens.astype(np.float64)
    per_tile = tok.sum() / vit.sum() if vit.sum() > 0 and tokens_follow_tiles else None
    vit_budget = max(math.ceil(vit.mean() * samples_per_pack * slack), int(lengths.vit.max()))
    if per_tile is None:
        token_budget = math.ceil(tok.mean() * samples_per_pack * slack)
    else:
        token_budget = math.ceil(vit_budget * per_tile * (1 + TOKEN_HEADROOM))
    token_budget = max(token_budget, int(lengths.tokens.max()))
    if max_vit_budget is not None and vit_budget > max_vit_budget:
        vit_budget = max_vit_budget
        if per_tile is not None:
            token_budget = max(math.ceil(vit_budget * per_tile * (1 + TOKEN_HEADROOM)),
                               int(lengths.tokens.max()))
    if max_token_budget is not None and token_budget > max_token_budget:
        token_budget = max_token_budget
        if per_tile is not None:
            vit_budget = min(vit_budget, math.floor(token_budget / (per_tile *
                                                                    (1 + TOKEN_HEADROOM))))
    token_budget = math.ceil(token_budget / TOKEN_ROUND) * TOKEN_ROUND
    if max_token_budget is not None:
        token_budget = min(token_budget, max_token_budget)
    return int(vit_budget), int(token_budget)
