"""The balancing core: the C++ extension (csrc/balance_core.cpp) or its Python reference.

Both take one parameter struct per packer (IsfParams, SlotParams) with the same fields; this
module builds it and picks the backend. `reference=True` (tests) runs the pure-Python mirror.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_omnibal.balance import reference

try:
    from megatron_omnibal import _balance_core as _native
except ImportError:  # not built: the reference runs (slowly), balance() still works
    _native = None

TOLERANCE_DIV = 400      # repair packs whose weight is off the mean by more than 1/400
TOLERANCE2_DIV = 100     # ... or whose second weight (modeled time) by more than 1/100
REPAIR_PASSES = 5        # passes of the swap repair
REPAIR_WINDOW = 8        # swap candidates per sample on either side of the ideal weight
REPAIR_PARTNERS = 4      # most-deviating packs of the other sign tried as swap partners
LOW_RATIO_PERCENTILE = 10.0   # see ratio_band()
HIGH_RATIO_PERCENTILE = 99.5
UNCUT_SHARE = 0.01       # heavy packs left over their weight target (no tile cut) before packs grow


def backend(use_reference: bool = False):
    return reference if use_reference or _native is None else _native


def u64(seed: int) -> int:
    return int(seed) & ((1 << 64) - 1)


def permutation(n: int, seed: int, *, use_reference: bool = False) -> np.ndarray:
    """Fisher-Yates permutation of range(n) driven by splitmix64(seed)."""
    return np.asarray(backend(use_reference).permutation(int(n), u64(seed)), np.int64)


def pack_isf(vit: np.ndarray, tokens: np.ndarray, *, vit_budget: int, token_budget: int,
             threshold: int, rounds: int, seed: int, use_reference: bool = False
             ) -> tuple[np.ndarray, np.ndarray]:
    """OmniBal ISF over positions of `vit`/`tokens`: (samples, pack_ptr)."""
    b = backend(use_reference)
    p = b.IsfParams()
    p.vit_budget, p.token_budget, p.token_threshold = int(vit_budget), int(token_budget), \
        int(threshold)
    p.rounds, p.seed = int(rounds), u64(seed)
    samples, ptr = b.isf(np.asarray(vit, np.int64), np.asarray(tokens, np.int64), p)
    return np.asarray(samples, np.int64), np.asarray(ptr, np.int64)


def pack_lpt(vit: np.ndarray, tokens: np.ndarray, params, *, use_reference: bool = False
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token balancing (longest-processing-time-first) into params.packs packs: (samples,
    pack_ptr, leftover) over positions of the arrays."""
    out = backend(use_reference).lpt_balance(
        *(np.asarray(a, np.int64) for a in (vit, tokens)), params)
    return tuple(np.asarray(a, np.int64) for a in out)


def ratio_band(vit: np.ndarray, weight: np.ndarray) -> tuple[int, int]:
    """A low and a high weight per tile of the data (x1024, integers). The low one is how
    lightly a pack's other tiles can be filled, which decides how many tiles a heavy sample's pack
    gives up; the high one how much weight a pack short of tiles can still carry.

    Percentiles over tiles, not samples: the ratio at which the tiles of the samples up to it
    (ratios ascending) first reach the share; found on the integer keys x1024 (floor for the
    low one, ceil for the high: both keep the order) by counting, without sorting."""
    has = vit > 0
    if not has.any():
        return 0, 0
    tiles, w = vit[has], weight[has]
    total = tiles.sum()
    mean = w.sum() / total
    ratio = w / tiles
    ratio *= 1024.0
    del w
    tiles = tiles.astype(np.float64)  # the counts' weights, converted once, not per bincount
    low = _percentile_key(np.floor(ratio).astype(np.int64), tiles, total, LOW_RATIO_PERCENTILE)
    high = _percentile_key(np.ceil(ratio).astype(np.int64), tiles, total, HIGH_RATIO_PERCENTILE)
    return min(low, math.floor(mean * 1024)), max(high, math.ceil(mean * 1024))


KEY_BITS = 16  # bits of a key counted per pass of _percentile_key


def _percentile_key(keys: np.ndarray, tiles: np.ndarray, total: int, percent: float) -> int:
    """The least key k (>= 0) with cumsum(tiles over keys <= k) / total * 100 >= percent: a
    count over the keys' high bits finds its bucket, a count over the low bits of that bucket's
    keys the key (the shares are evaluated as a cumulative sum over sorted keys would give them,
    so the answer is the same)."""
    shift = max(int(keys.max()).bit_length() - KEY_BITS, 0)
    high = np.bincount(keys >> shift, tiles)
    below = np.concatenate([[0.0], np.cumsum(high)])
    bucket = min(int(np.searchsorted(below[1:] / total * 100.0, percent)), len(high) - 1)
    inside = (keys >> shift) == bucket
    low = np.bincount(keys[inside] & ((1 << shift) - 1), tiles[inside])
    at = (below[bucket] + np.cumsum(low)) / total * 100.0
    return (bucket << shift) + min(int(np.searchsorted(at, percent)), len(low) - 1)


def slot_params(*, vit_budget: int, token_budget: int, packs: int, grow: int, seed: int,
                band: tuple[int, int], repair: bool, use_reference: bool = False):
    """The backend's SlotParams for one slot_balance call."""
    p = backend(use_reference).SlotParams()
    p.vit_budget, p.token_budget, p.packs, p.grow = int(vit_budget), int(token_budget), \
        int(packs), int(grow)
    p.max_uncut = int(UNCUT_SHARE * packs)
    p.seed = u64(seed)
    p.repair_passes = REPAIR_PASSES if repair else 0
    p.tol_div, p.tol2_div = TOLERANCE_DIV, TOLERANCE2_DIV
    p.window, p.partners = REPAIR_WINDOW, REPAIR_PARTNERS
    p.ratio_lo, p.ratio_hi = int(band[0]), int(band[1])
    return p


def pack_slots(vit: np.ndarray, weight: np.ndarray, weight2: np.ndarray, tokens: np.ndarray,
               params, *, use_reference: bool = False
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slot balancing: (samples, pack_ptr, leftover) over positions of the arrays; `weight` is
    placed and repaired, `weight2` (>= 0; zeros: none) repaired beside it."""
    out = backend(use_reference).slot_balance(
        *(np.asarray(a, np.int64) for a in (vit, weight, weight2, tokens)), params)
    return tuple(np.asarray(a, np.int64) for a in out)
