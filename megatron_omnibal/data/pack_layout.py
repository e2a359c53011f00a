"""Lay packs out over (global step, data-parallel rank, micro-batch).

Every step gets exactly dp * micro_batches packs (Megatron needs the same number of micro-batches
on every rank), so the packer is asked for a multiple of that. `random` draws each step's packs
at random, stratified by each pack's dominant dataset and tile count (every step gets its share
of each stratum), so a step's dataset mix is at least as close to the epoch's as a plain
shuffle's; `grouped` puts packs of similar size into the same step (the tightest balance).
Either way the order of the steps is then shuffled. Within a step, ranks get their
micro_batches packs by a serpentine deal of the step's packs sorted by size, so per-rank totals
even out when micro_batches > 1.
"""

from __future__ import annotations

import numpy as np

from megatron_omnibal.data import isf

MODES = ("random", "grouped")
_LAYOUT_SALT = 0x4C41594F5554  # "LAYOUT": the layout's RNG stream differs from the packer's


def pack_size_key(pack_vit: np.ndarray, pack_weight: np.ndarray) -> np.ndarray:
    """One number per pack: its tiles and weight, each relative to the mean, added."""
    mv = max(float(pack_vit.mean()), 1e-9) if len(pack_vit) else 1.0
    mw = max(float(pack_weight.mean()), 1e-9) if len(pack_weight) else 1.0
    return pack_vit / mv + pack_weight / mw


def layout(pack_vit: np.ndarray, pack_weight: np.ndarray, dp_size: int, micro_batches: int,
           mode: str, seed: int, pack_dataset: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pack_step, pack_rank, pack_micro) for packs whose count is a multiple of dp*micro.

    `pack_dataset` (each pack's most frequent source dataset) stratifies the random mode.
    """
    if mode not in MODES:
        raise ValueError(f"layout: unknown mode '{mode}' (choose from {', '.join(MODES)})")
    per_step = dp_size * micro_batches
    num = len(pack_vit)
    if num % per_step:
        raise ValueError(f"layout: {num} packs is not a multiple of dp*micro = {per_step}")
    steps = num // per_step
    key = pack_size_key(np.asarray(pack_vit, np.float64), np.asarray(pack_weight, np.float64))
    step = np.empty(num, np.int64)
    if mode == "random":
        # Stratified: packs in random order within strata (dominant dataset, then tiles), dealt
        # to the steps in turn, so every step gets its share of each stratum.
        shuffled = isf.permutation(num, seed ^ _LAYOUT_SALT)
        rank_in = np.empty(num, np.int64)
        rank_in[shuffled] = np.arange(num)
        strata = (np.zeros(num, np.int64) if pack_dataset is None
                  else np.asarray(pack_dataset, np.int64))
        order = np.lexsort((rank_in, pack_vit, strata))
        step[order] = np.arange(num) % steps if steps else 0
    else:
        order = np.lexsort((pack_weight, pack_vit))  # same tiles, then similar weight
        step[order] = np.arange(num) // per_step
    if steps:
        step = isf.permutation(steps, seed ^ _LAYOUT_SALT ^ 1)[step]
    # Within each step: heaviest first, dealt to ranks in a serpentine (0..dp-1, dp-1..0, ...).
    within = np.lexsort((-key, step))
    k = np.empty(num, np.int64)
    k[within] = np.arange(num) % per_step
    rnd, j = k // dp_size, k % dp_size
    rank = np.where(rnd % 2 == 0, j, dp_size - 1 - j)
    return step, rank, rnd
