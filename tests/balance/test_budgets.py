"""The one budget rule (balance/budgets.py) in the planner's form: each micro-batch's mean share
of the samples with slack, never below the largest sample, tokens rounded up to 64, checked
against that rule written out by hand."""

import math

import numpy as np

from megatron_omnibal.balance.budgets import auto_budget
from megatron_omnibal.data.lengths import from_arrays


def by_hand(vit: np.ndarray, tokens: np.ndarray, share: float, slack: float) -> tuple[int, int]:
    tiles = max(int(vit.max()), math.ceil(float(vit.mean()) * share * slack))
    toks = max(int(tokens.max()), math.ceil(float(tokens.mean()) * share * slack))
    return tiles, math.ceil(toks / 64) * 64


def test_the_planners_budgets_are_the_mean_share_with_slack_from_the_mean_sample() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        size = int(rng.integers(1, 2000))
        vit = rng.integers(0, int(rng.integers(2, 40)), size)
        tokens = rng.integers(1, int(rng.integers(2, 8000)), size)
        share = int(rng.integers(1, 256)) / int(rng.integers(1, 32))
        got = auto_budget(from_arrays(vit, tokens), samples_per_pack=share, slack=1.05,
                          tokens_follow_tiles=False)
        assert got == by_hand(vit, tokens, share, 1.05)


def test_by_default_the_token_budget_follows_the_tile_budget() -> None:
    """One huge image sample sets the tile budget; the tokens follow it, not the mean."""
    vit, tokens = np.array([1] * 99 + [40]), np.array([100] * 99 + [4000])
    lengths = from_arrays(vit, tokens)
    tiles, toks = auto_budget(lengths, samples_per_pack=4)
    assert tiles == 40 and toks >= 40 * tokens.sum() / vit.sum()
    assert auto_budget(lengths, samples_per_pack=4, tokens_follow_tiles=False) == (40, 4032)
