"""Lay packs out over (global step, data-parallel rank, micro-batch).

Every step gets exactly dp * micro_batches packs (Megatron needs the same number of micro-batches
on every rank), so the packer is asked for a multiple of that. `random` draws each step's packs
at random, stratified by each pack's dominant dataset and tile count (every step gets its share
of each stratum), so a step's dataset mix is at least as close to the epoch's as a plain
shuffle's; `grouped` puts packs of similar size into the same step (the tightest balance).
With a modeled time per pack (tiles and tokens are even, but attention, sum(len^2), is not),
the slowest `time_tail` of the packs form steps of their own, sorted by time (HBP's
attention-balance sort), so that they do not set the pace of the other steps; the rest are
drawn at random as above. A larger tail evens the time out more and skews those steps' mix
more. Either way the order of the steps is then shuffled. Within a step, ranks get their
micro_batches packs by a serpentine deal of the step's packs sorted by size, so per-rank totals
even out when micro_batches > 1.
"""

from __future__ import annotations

import numpy as np

from megatron_omnibal.balance.config import MODES
from megatron_omnibal.balance.core import permutation

_LAYOUT_SALT = 0x4C41594F5554  # "LAYOUT": the layout's RNG stream differs from the packer's


def pack_size_key(*values: np.ndarray) -> np.ndarray:
    """One number per pack: each of its sizes (tiles, tokens, time) relative to its mean, added."""
    out = np.zeros(len(values[0]))
    for v in values:
        v = np.asarray(v, np.float64)
        out += v / max(float(v.mean()), 1e-9) if len(v) else 0.0
    return out


def time_bands(pack_time: np.ndarray, per_step: int, time_tail: float) -> list[np.ndarray]:
    """Packs (indices) in bands of whole steps: the slowest `time_tail` of the packs, sorted by
    modeled time, one band per step; the rest one band."""
    order = np.argsort(pack_time, kind="stable")
    steps = len(order) // per_step
    tail = min(steps, int(np.ceil(time_tail * steps)))
    cut = (steps - tail) * per_step
    bands = [order[:cut]] if cut else []
    bands += [order[k:k + per_step] for k in range(cut, len(order), per_step)]
    return bands


def layout(pack_vit: np.ndarray, pack_weight: np.ndarray, dp_size: int, micro_batches: int,
           mode: str, seed: int, pack_dataset: np.ndarray | None = None,
           pack_time: np.ndarray | None = None, time_tail: float = 0.0
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pack_step, pack_rank, pack_micro) for packs whose count is a multiple of dp*micro.

    `pack_dataset` (each pack's most frequent source dataset) stratifies the random mode;
    `pack_time` (modeled ms) bands it and orders the grouped mode.
    """
    if mode not in MODES:
        raise ValueError(f"layout: unknown mode '{mode}' (choose from {', '.join(MODES)})")
    per_step = dp_size * micro_batches
    num = len(pack_vit)
    if num % per_step:
        raise ValueError(f"layout: {num} packs is not a multiple of dp*micro = {per_step}")
    steps = num // per_step
    sizes = (pack_vit, pack_weight) if pack_time is None else (pack_vit, pack_weight, pack_time)
    key = pack_size_key(*sizes)
    step = np.empty(num, np.int64)
    if mode == "random":
        # Stratified: packs in random order within strata (dominant dataset, then tiles), dealt
        # to the steps of their band in turn, so every step gets its share of each stratum.
        shuffled = permutation(num, seed ^ _LAYOUT_SALT)
        rank_in = np.empty(num, np.int64)
        rank_in[shuffled] = np.arange(num)
        strata = (np.zeros(num, np.int64) if pack_dataset is None
                  else np.asarray(pack_dataset, np.int64))
        bands = ([np.arange(num)] if pack_time is None or steps == 0
                 else time_bands(pack_time, per_step, time_tail))
        first = 0
        for band in bands:
            order = band[np.lexsort((rank_in[band], pack_vit[band], strata[band]))]
            count = len(band) // per_step
            step[order] = first + np.arange(len(band)) % count
            first += count
    else:  # same tiles, then similar time (or weight)
        order = np.lexsort((pack_weight if pack_time is None else pack_time, pack_vit))
        step[order] = np.arange(num) // per_step
    if steps:
        step = permutation(steps, seed ^ _LAYOUT_SALT ^ 1)[step]
    # Within each step: heaviest first, dealt to ranks in a serpentine (0..dp-1, dp-1..0, ...).
    within = np.lexsort((-key, step))
    k = np.empty(num, np.int64)
    k[within] = np.arange(num) % per_step
    rnd, j = k // dp_size, k % dp_size
    rank = np.where(rnd % 2 == 0, j, dp_size - 1 - j)
    return step, rank, rnd
