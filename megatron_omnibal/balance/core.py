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
    gives up; the high one how much weight a pack short of tiles can still carry."""
    has = vit > 0
    if not has.any():
        return 0, 0
    ratio = weight[has] / vit[has]
    mean = weight[has].sum() / vit[has].sum()
    order = np.argsort(ratio, kind="stable")  # percentiles over tiles, not samples
    at = np.cumsum(vit[has][order]) / vit[has].sum() * 100.0
    low = min(ratio[order][np.searchsorted(at, LOW_RATIO_PERCENTILE)], mean)
    high = max(ratio[order][min(np.searchsorted(at, HIGH_RATIO_PERCENTILE), len(at) - 1)], mean)
    return int(math.floor(low * 1024)), int(math.ceil(high * 1024))


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
