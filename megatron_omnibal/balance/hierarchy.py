"""Hierarchical balance packing (HBP, arXiv 2503.07680) adapted to vision-language data.

Levels are (tile budget, token budget) pairs, ascending. Each sample goes to the smallest level
that fits it; the packs of a long level are topped up with short samples (GreedyFill: from the
next shorter level down, while there is room), so long packs run full; every global step draws
all its packs from one level; steps of the levels are interleaved in proportion to their
counts, after an optional curriculum of the shortest level's steps.
"""

from __future__ import annotations

import numpy as np

from megatron_omnibal.balance import packing
from megatron_omnibal.balance.config import Level

TOP_UP_FILL = 0.95   # GreedyFill tops long packs up to this share of their free tiles and tokens
_LEVEL_SALT = 0x4C4556454C  # "LEVEL"


def assign_levels(vit: np.ndarray, tokens: np.ndarray, levels: tuple[Level, ...]) -> np.ndarray:
    """Index of the smallest level whose budgets hold each sample (len(levels) if none does)."""
    out = np.full(len(vit), len(levels), np.int64)
    for i in range(len(levels) - 1, -1, -1):
        out[levels[i].fits(vit, tokens)] = i
    return out


def top_up(candidates: list[np.ndarray], vit: np.ndarray, tokens: np.ndarray,
           free_tiles: float, free_tokens: float, big_room: int,
           budgets: tuple[int, int]) -> np.ndarray:
    """GreedyFill's choice: samples from the candidate lists in turn (nearest shorter level
    first, each in its given order) while their running totals stay within TOP_UP_FILL of the
    free room; a sample that would overflow is passed over, as GreedyFill does. A sample over
    half a budget (`budgets`) also needs a pack without one: at most `big_room` of them (more
    would fit the totals but not the packs)."""
    room_v, room_t = free_tiles * TOP_UP_FILL, free_tokens * TOP_UP_FILL
    chosen = []
    for cand in candidates:
        if room_t <= 0:
            break
        v, t = vit[cand].astype(np.float64), tokens[cand].astype(np.float64)
        large = packing.big(vit[cand], tokens[cand], *budgets)
        cv, ct, cb = np.cumsum(v), np.cumsum(t), np.cumsum(large)
        take = (cv <= room_v) & (ct <= room_t) & (cb <= big_room)
        # past the first overflow, keep going with the samples that still fit (greedy)
        stop = int(np.argmin(take)) if not take.all() else len(cand)
        picked = list(cand[:stop])
        used_v, used_t = float(cv[stop - 1]) if stop else 0.0, float(ct[stop - 1]) if stop else 0.0
        used_b = int(cb[stop - 1]) if stop else 0
        for j in range(stop, len(cand)):
            if used_v + v[j] <= room_v and used_t + t[j] <= room_t and \
                    used_b + int(large[j]) <= big_room:
                picked.append(int(cand[j]))
                used_v += v[j]
                used_t += t[j]
                used_b += int(large[j])
        chosen.extend(picked)
        room_v -= used_v
        room_t -= used_t
        big_room -= used_b
    return np.asarray(chosen, np.int64)


def interleave(steps: list[int], curriculum_steps: int, seed: int) -> np.ndarray:
    """Level of each global step: `curriculum_steps` steps of level 0 first (as many as it has),
    then every level's remaining steps spread evenly over the rest (level l's k-th step at
    position (k + u_l) / n_l, u_l a random offset), so any stretch of steps mixes the levels in
    proportion to their step counts."""
    first = min(curriculum_steps, steps[0]) if steps else 0
    keys, level = [], []
    rng = np.random.default_rng(seed ^ _LEVEL_SALT)
    for lv, n in enumerate(steps):
        n_left = n - first if lv == 0 else n
        if n_left <= 0:
            continue
        keys.append((np.arange(n_left) + rng.random()) / n_left)
        level.append(np.full(n_left, lv, np.int64))
    if not keys:
        return np.zeros(first, np.int64)
    k, lv = np.concatenate(keys), np.concatenate(level)
    order = np.lexsort((lv, k))
    return np.concatenate([np.zeros(first, np.int64), lv[order]])

