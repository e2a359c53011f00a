"""Per-group histograms of a small-integer value (the source dataset of the samples of each pack
or step), kept sparse: only the (group, value) pairs that occur, never a dense groups x values
table. A length file's meta entries are datasets, and a real mix can have hundreds of them: a
dense table over millions of packs would grow with packs x datasets (tens of GB at 12 million
samples and 680 datasets); the pairs that occur are at most one per sample.
"""

from __future__ import annotations

import numpy as np


def pair_counts(group: np.ndarray, value: np.ndarray, values: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(group, value, count) of every pair that occurs, in (group, value) order. Linear in time
    when `group` is already non-decreasing (the samples of packs, of steps): the stable sort then
    only merges the short runs within each group."""
    key = np.multiply(group, max(int(values), 1), dtype=np.int64)
    key += value
    key.sort(kind="stable")
    if len(key) == 0:
        return key, key.copy(), key.copy()
    first = np.empty(len(key), bool)
    first[0] = True
    np.not_equal(key[1:], key[:-1], out=first[1:])
    starts = np.flatnonzero(first)
    del first
    counts = np.diff(np.append(starts, len(key)))
    pairs = key[starts]
    del key
    g, v = np.divmod(pairs, max(int(values), 1))
    return g, v, counts


def most_frequent(group: np.ndarray, value: np.ndarray, groups: int, values: int) -> np.ndarray:
    """Per group 0..groups-1: its most frequent value, the smallest on ties, 0 for an empty
    group (a dense table's argmax per row)."""
    g, v, c = pair_counts(group, value, values)
    out = np.zeros(groups, np.int64)
    if len(g) == 0:
        return out
    starts = np.flatnonzero(np.append(True, g[1:] != g[:-1]))
    # one score per pair: the count first, then the smaller value (values - 1 - v >= 0)
    span = max(int(values), 1)
    score = c * span
    score += span - 1 - v
    best = np.maximum.reduceat(score, starts)
    out[g[starts]] = span - 1 - best % span
    return out


def total_variation(group: np.ndarray, value: np.ndarray, groups: int, values: int
                    ) -> np.ndarray:
    """Per group: the total-variation distance 0.5 * sum_v |q_group(v) - p(v)| between the
    group's histogram of values and all groups' together; 0 for an empty group. The values a
    group lacks add p(v) each: 1 - the sum of p over the values it has."""
    g, v, c = pair_counts(group, value, values)
    out = np.zeros(groups)
    if len(g) == 0:
        return out
    c = c.astype(np.float64)
    p = np.bincount(v, c, values) / c.sum()
    rows = np.bincount(g, c, groups)
    present = np.abs(c / rows[g] - p[v])
    near = np.bincount(g, present, groups)
    covered = np.bincount(g, p[v], groups)
    has = rows > 0
    out[has] = 0.5 * (near[has] + np.maximum(1.0 - covered[has], 0.0))
    return out
