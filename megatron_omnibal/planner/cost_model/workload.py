"""Micro-batch workloads drawn from length statistics: balanced (budgets) or fixed-size.

The planner predicts a step from real sample lengths, so it needs micro-batches like the ones
training will see. Balanced ones are modelled by a longest-first greedy fill of dp x m bins
towards both budgets (a stand-in for the ISF balancer, which does at least this well); the
baselines take the same samples in random order, a fixed number per micro-batch, padded.
"""

from __future__ import annotations

import numpy as np

from megatron_omnibal.data.lengths import LengthStats
from megatron_omnibal.planner.cost_model.costs import workload_features


def draw_samples(stats: LengthStats, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` sample indices drawn without replacement (with, if the data is smaller)."""
    return rng.choice(len(stats), size=count, replace=count > len(stats))


def balanced_features(
    stats: LengthStats, index: np.ndarray, bins: int, vit_budget: int, token_budget: int
) -> np.ndarray:
    """Features (bins, 4) of a greedy balanced split of samples `index` into `bins`.

    Largest samples first, each into the bin whose fuller dimension (tiles / vit_budget or
    tokens / token_budget) ends lowest, so both the vision and the language work even out.
    """
    vit = stats.vit[index].astype(np.float64)
    tok = stats.tokens[index].astype(np.float64)
    tiles, tokens, sumsq = np.zeros(bins), np.zeros(bins), np.zeros(bins)
    order = np.argsort(-np.maximum(tok / token_budget, vit / vit_budget), kind="stable")
    for i in order:
        after = np.maximum((tiles + vit[i]) / vit_budget, (tokens + tok[i]) / token_budget)
        b = int(np.argmin(after))
        tiles[b] += vit[i]
        tokens[b] += tok[i]
        sumsq[b] += tok[i] ** 2
    return workload_features(tiles, tokens, sumsq)


def deal_to_replicas(
    features: np.ndarray, dp: int, vit_budget: int, token_budget: int
) -> np.ndarray:
    """(dp, m, 4): micro-batches dealt to replicas so each replica's total evens out too.

    The slowest replica gates the step, so balance matters across DP ranks as well as within
    a pipeline: heaviest micro-batch first, to the replica (with room) whose fuller total
    dimension stays lowest.
    """
    m = len(features) // dp
    load = np.maximum(features[:, 0] / vit_budget, features[:, 1] / token_budget)
    tiles, tokens = np.zeros(dp), np.zeros(dp)
    slots: list[list[int]] = [[] for _ in range(dp)]
    for i in np.argsort(-load, kind="stable"):
        after = np.maximum(
            (tiles + features[i, 0]) / vit_budget, (tokens + features[i, 1]) / token_budget
        )
        after[[len(x) >= m for x in slots]] = np.inf
        r = int(np.argmin(after))
        slots[r].append(int(i))
        tiles[r] += features[i, 0]
        tokens[r] += features[i, 1]
    return np.stack([features[x] for x in slots])


def padded_features(stats: LengthStats, index: np.ndarray, bins: int) -> np.ndarray:
    """Features (bins, 4) of fixed-size micro-batches: the samples in their (random) order,
    equal counts per bin, every sample padded to the longest of its micro-batch.

    That is how a fixed micro-batch size runs in Megatron: the LLM sees count x longest tokens
    (attention count x longest^2), the ViT every real tile (tiles are not padded).
    """
    parts = np.array_split(index, bins)
    vit, tok = stats.vit.astype(np.float64), stats.tokens.astype(np.float64)
    longest = np.array([tok[p].max() for p in parts])
    count = np.array([len(p) for p in parts], np.float64)
    return workload_features(
        [vit[p].sum() for p in parts], count * longest, count * longest**2
    )
