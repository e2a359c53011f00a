"""Lay packs out over (global step, data-parallel rank, micro-batch).

Every step gets exactly dp * micro_batches packs (Megatron needs the same number of micro-batches
on every rank), so the packer is asked for a multiple of that. `random` keeps each step's content
a uniform random draw of packs, so the dataset mix per step is as random as a plain shuffle;
`grouped` puts packs of similar size into the same step (the tightest balance) and then shuffles
the order of the steps. Within a step, ranks get their micro_batches packs by a serpentine deal
of the step's packs sorted by size, so per-rank totals even out when micro_batches > 1.
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
           mode: str, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(pack_step, pack_rank, pack_micro) for packs whose count is a multiple of dp*micro."""
    if mode not in MODES:
        raise ValueError(f"layout: unknown mode '{mode}' (choose from {', '.join(MODES)})")
    per_step = dp_size * micro_batches
    num = len(pack_vit)
    if num % per_step:
        raise ValueError(f"layout: {num} packs is not a multiple of dp*micro = {per_step}")
    steps = num // per_step
    key = pack_size_key(np.asarray(pack_vit, np.float64), np.asarray(pack_weight, np.float64))
    if mode == "random":
        order = isf.permutation(num, seed ^ _LAYOUT_SALT)
    else:
        order = np.lexsort((pack_weight, pack_vit))  # same tiles, then similar weight
    step = np.empty(num, np.int64)
    step[order] = np.arange(num) // per_step
    if mode == "grouped":
        step = isf.permutation(steps, seed ^ _LAYOUT_SALT)[step] if steps else step
    # Within each step: heaviest first, dealt to ranks in a serpentine (0..dp-1, dp-1..0, ...).
    within = np.lexsort((-key, step))
    k = np.empty(num, np.int64)
    k[within] = np.arange(num) % per_step
    rnd, j = k // dp_size, k % dp_size
    rank = np.where(rnd % 2 == 0, j, dp_size - 1 - j)
    return step, rank, rnd
