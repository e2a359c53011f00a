"""Lay packs out over (global step, data-parallel rank, micro-batch).

Every step gets exactly dp * micro_batches packs (Megatron needs the same number of micro-batches
on every rank), so the packer is asked for a multiple of that. A step waits for its largest
pack, so what matters is that the packs of one step are alike in tiles, tokens and modeled
time. `random` draws each step's packs at random, stratified by each pack's dominant dataset and
tile count (every step gets its share of each stratum), so a step's dataset mix is at least as
close to the epoch's as a plain shuffle's; the packs the packer could not bring to the common
level (over the mean tokens or time, or the full tiles, by more than `tail_tolerance`; then, while
what packs lack in tiles, tokens or time would cost more than that, the lightest packs: a light
pack lowers its step's mean as a heavy one raises its max) first form steps
of their own among packs alike in all three (HBP's attention-balance sort, in three
dimensions), so that they do not set the pace of the others. A smaller tolerance evens the steps
out more and skews more steps' mix. `grouped` forms every step from packs alike in all three
(the tightest balance, the most skew). Either way the order of the steps is then shuffled.
Within a step, ranks get their micro_batches packs by a serpentine deal of the step's packs
sorted by size, so per-rank totals even out when micro_batches > 1.
"""

from __future__ import annotations

import numpy as np

from megatron_omnibal.balance.config import MODES
from megatron_omnibal.balance.core import permutation

_LAYOUT_SALT = 0x4C41594F5554  # "LAYOUT": the layout's RNG stream differs from the packer's


def relative_sizes(pack_vit: np.ndarray, pack_weight: np.ndarray, pack_time: np.ndarray,
                   solo: np.ndarray | None = None) -> np.ndarray:
    """(packs, 3): tiles over the median pack's (a full one), tokens and time over their means,
    the median and means over the packs not `solo` (oversize samples alone in their packs, over
    the budgets: counted in, they would raise the level the other packs are measured by, and
    hide the packs that are heavy among those)."""
    basis = slice(None) if solo is None or solo.all() else ~np.asarray(solo, bool)
    out = [np.asarray(pack_vit, np.float64)]
    out[0] = out[0] / max(float(np.median(out[0][basis])), 1.0) if len(out[0]) else out[0]
    for x in (pack_weight, pack_time):
        x = np.asarray(x, np.float64)
        out.append(x / max(float(x[basis].mean()), 1e-300) if len(x) else x)
    return np.stack(out, axis=1)


GROUP_WINDOW = 128  # steps' worth of packs, in time order, a group's packs are chosen among


def nearest(dist: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k smallest distances, ties to the lower position (a stable argsort's
    first k, in linear time)."""
    if k >= len(dist):
        return np.arange(len(dist))
    cut = np.partition(dist, k - 1)[k - 1]
    below = np.flatnonzero(dist < cut)
    return np.concatenate([below, np.flatnonzero(dist == cut)[:k - len(below)]])


def nearest_groups(packs: np.ndarray, sizes: np.ndarray, per_step: int) -> list[np.ndarray]:
    """`packs` in groups of per_step packs alike in every size (rows of `sizes`, relative):
    the slowest pack left with the per_step - 1 packs nearest to it (largest difference over the
    sizes) among the next GROUP_WINDOW * per_step in time order. Sorting by one size would put
    packs of very different tiles, or very different time, into one step. The window's sizes
    are kept as columns beside it (no row gathers per group)."""
    order = packs[np.argsort(-sizes[packs, -1], kind="stable")]
    cols = [np.ascontiguousarray(sizes[order, j]) for j in range(sizes.shape[1])]
    window = GROUP_WINDOW * per_step
    head, near, at, groups = order[:0], [c[:0] for c in cols], 0, []
    while at < len(order) or len(head):
        more = min(window - len(head), len(order) - at)
        head = np.concatenate([head, order[at:at + more]])
        near = [np.concatenate([n, c[at:at + more]]) for n, c in zip(near, cols, strict=True)]
        at += more
        dist = np.abs(near[0] - near[0][0])
        for n in near[1:]:
            np.maximum(dist, np.abs(n - n[0]), out=dist)
        pick = nearest(dist, per_step)
        groups.append(np.sort(head[pick]))
        keep = np.ones(len(head), bool)
        keep[pick] = False
        head, near = head[keep], [n[keep] for n in near]
    return groups


def tail_bands(sizes: np.ndarray, per_step: int, tolerance: float, micro_batches: int = 1
               ) -> tuple[list[np.ndarray], np.ndarray]:
    """(steps of their own, the rest) from the packs' relative sizes (relative_sizes):

    - packs over 1 + `tolerance` * micro_batches in any size (a heavy sample the data had no
      light partners for, an oversize sample alone; a rank's load is the sum of its
      micro_batches packs, which dilutes one pack's excess), in as many whole steps as they
      fill (topped up with the next most over);
    - then the light packs (light_packs): while what the other packs lack against the largest
      a random step draws, in tiles, tokens or time, adds up to more than the tolerance, a
      step's worth of the packs lowest in that size;
    - both kinds grouped together by nearest_groups, so each such step holds packs alike in
      every size.
    """
    num = len(sizes)
    over = sizes.max(axis=1) - 1.0 if num else np.zeros(0)
    heavy = int(np.count_nonzero(over > tolerance * micro_batches))
    count = min(num // per_step, -(-heavy // per_step))
    order = np.argsort(-over, kind="stable")
    rest = order[count * per_step:]
    light = (light_packs(sizes, rest, per_step, tolerance, micro_batches) if len(rest)
             else rest[:0])
    tail = np.concatenate([order[:count * per_step], light])
    bands = nearest_groups(tail, sizes, per_step) if len(tail) else []
    if len(light):
        keep = np.ones(num, bool)
        keep[light] = False
        rest = rest[keep[rest]]
    return bands, np.sort(rest)


def light_packs(sizes: np.ndarray, rest: np.ndarray, per_step: int, tolerance: float,
                micro_batches: int = 1) -> np.ndarray:
    """The lightest packs of `rest`, a step's worth at a time, while what the packs left lack
    against the largest pack a random step of them draws, in any size (tiles, tokens, time),
    adds up to more than `tolerance` of it: a light pack lowers its step's mean, which raises
    the step's max/mean as a heavy pack does. Each step's worth is the packs lowest in the size
    whose lack is then the largest beyond what is allowed (ties: least time)."""
    dims = sizes.shape[1]
    free = np.ones(len(sizes), bool)
    orders: list[np.ndarray | None] = [None] * dims  # sorted when first needed
    at = [0] * dims
    # the largest pack a random step draws (about its 1 - 1/per_step quantile), not the rest's
    # largest: that one grows with the number of packs
    top = np.quantile(sizes[rest], 1.0 - 1.0 / per_step, axis=0, method="higher")
    lack = top * len(rest) - sizes[rest].sum(axis=0)
    # tiles: a lack every rank shares, however many packs it has; tokens and time: a rank's
    # load sums its micro_batches packs, which dilutes one light pack
    allowed = np.full(dims, tolerance * micro_batches)
    allowed[0] = tolerance
    left, picked = len(rest), []
    while left > per_step:
        beyond = (lack - allowed * top * left) / np.maximum(top, 1e-300)
        j = int(np.argmax(beyond))
        if beyond[j] <= 0:
            break
        if orders[j] is None:
            orders[j] = rest[np.lexsort((sizes[rest, -1], sizes[rest, j]))]
        o, k, pick = orders[j], at[j], []
        while len(pick) < per_step:
            if free[o[k]]:
                pick.append(o[k])
            k += 1
        if sizes[pick[-1], j] >= top[j]:  # the lightest are as large as the largest
            break
        at[j] = k
        free[pick] = False
        picked += pick
        lack -= top * per_step - sizes[pick].sum(axis=0)
        left -= per_step
    return np.array(picked, np.int64)


def _dense_ranks(x: np.ndarray) -> np.ndarray:
    """Integers 0.. in the order of `x`, equal where x is equal."""
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.integer) and len(x):
        return x.astype(np.int64) - int(x.min())
    return np.unique(x, return_inverse=True)[1].astype(np.int64)


def _sorted_keys(major: np.ndarray, minor: np.ndarray, distinct: np.ndarray, num: int
                 ) -> np.ndarray:
    """np.lexsort((distinct, minor, major))'s order as sorted keys (major, minor) * num +
    distinct, where `distinct` holds distinct integers 0..num-1: one sort of distinct integers,
    so any sort gives the same order, and it carries `distinct` (key % num); the lexsort
    itself where the keys would not fit 63 bits."""
    major, minor = _dense_ranks(major), _dense_ranks(minor)
    if len(major) == 0:
        return major
    span = int(minor.max()) + 1
    if (int(major.max()) + 1) * span * num >= 1 << 63:
        return distinct[np.lexsort((distinct, minor, major))]  # < num: key % num the same
    return np.sort((major * span + minor) * num + distinct)


def layout(pack_vit: np.ndarray, pack_weight: np.ndarray, pack_time: np.ndarray, dp_size: int,
           micro_batches: int, mode: str, seed: int, pack_dataset: np.ndarray | None = None,
           tail_tolerance: float | None = 0.015, solo: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pack_step, pack_rank, pack_micro) for packs whose count is a multiple of dp*micro.

    `pack_dataset` (each pack's most frequent source dataset) stratifies the random mode;
    tail_tolerance None: no steps of their own (every pack drawn at random, as OmniBal's
    sampler draws ISF's packs).
    """
    if mode not in MODES:
        raise ValueError(f"layout: unknown mode '{mode}' (choose from {', '.join(MODES)})")
    per_step = dp_size * micro_batches
    num = len(pack_vit)
    if num % per_step:
        raise ValueError(f"layout: {num} packs is not a multiple of dp*micro = {per_step}")
    steps = num // per_step
    sizes = relative_sizes(pack_vit, pack_weight, pack_time, solo)
    step = np.empty(num, np.int64)
    if mode == "random":
        bands, rest = (([], np.arange(num)) if tail_tolerance is None
                       else tail_bands(sizes, per_step, tail_tolerance, micro_batches))
        # Stratified: packs in random order within strata (dominant dataset, then tiles), dealt
        # to the steps in turn, so every step gets its share of each stratum.
        shuffled = permutation(num, seed ^ _LAYOUT_SALT)
        rank_in = np.empty(num, np.int64)
        rank_in[shuffled] = np.arange(num)
        strata = (np.zeros(num, np.int64) if pack_dataset is None
                  else np.asarray(pack_dataset, np.int64))
        order = shuffled[_sorted_keys(strata[rest], pack_vit[rest], rank_in[rest], num) % num]
        if len(rest):
            step[order] = len(bands) + np.arange(len(rest)) % (len(rest) // per_step)
    else:
        bands = nearest_groups(np.arange(num), sizes, per_step)
    for k, band in enumerate(bands):
        step[band] = k
    if steps:
        step = permutation(steps, seed ^ _LAYOUT_SALT ^ 1)[step]
    # Within each step: largest first, dealt to ranks in a serpentine (0..dp-1, dp-1..0, ...).
    by_size = np.argsort(-sizes.sum(axis=1), kind="stable")
    size_rank = np.empty(num, np.int64)
    size_rank[by_size] = np.arange(num)
    within = by_size[np.sort(step * num + size_rank) % num]  # by (step, size rank)
    k = np.empty(num, np.int64)
    k[within] = np.arange(num) % per_step
    rnd, j = k // dp_size, k % dp_size
    rank = np.where(rnd % 2 == 0, j, dp_size - 1 - j)
    return step, rank, rnd
