"""The balancer: pack samples so every micro-batch carries the same vision and language work.

Two packers over the C++ core (csrc/isf_core.cpp; isf_reference.py is its pure-Python mirror):

- `isf`: OmniBal's Iterative Sampling and Filtering, faithfully: shuffle, fill packs in order
  until the next sample would exceed a budget, keep the full packs (tiles == tile budget or
  tokens >= threshold), re-shuffle and re-pack the others, for `rounds` rounds, keeping the last
  round as it is. Unlike the reference it never drops a sample: oversize samples follow the
  oversize policy and the last open pack is kept.
- `default` (slot balancing, see csrc/isf_core.cpp): the pack count is a whole number of steps
  from the start; each pack's tile slots are chosen so its tiles hit the target exactly, then
  samples are dealt into slots of their tile count so that every pack carries the same weight
  (tokens or a cost), and a swap repair evens out what is left. Samples too heavy for a full
  pack start packs that give up tiles instead of going over on weight.

`balance()` ties packer, oversize policy and layout together into a `BalancePlan`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from megatron_omnibal.data import isf_reference
from megatron_omnibal.data.lengths import LengthStats
from megatron_omnibal.data.plan_io import BalancePlan

try:
    from megatron_omnibal import _isf_core as _core
except ImportError:  # not built: the reference runs (slowly), balance() still works
    _core = None

ALGORITHMS = ("default", "isf")
OVERSIZE = ("error", "solo", "skip")
VERSION = 1
TOLERANCE_DIV = 400      # repair packs whose weight is off the mean by more than 1/400
REPAIR_PASSES = 8        # passes of the swap repair
REPAIR_WINDOW = 8        # swap candidates per sample on either side of the ideal weight
REPAIR_PARTNERS = 4      # most-deviating packs of the other sign tried as swap partners
LOW_RATIO_PERCENTILE = 10.0   # see ratio_band()
HIGH_RATIO_PERCENTILE = 99.5
MAX_RETRIES = 64
CHUNK = 80_000           # samples packed together (larger inputs: chunks of this size)


@dataclass(frozen=True)
class CostModel:
    """Per-sample cost a*tiles + b*tokens + c*tokens^2 (attention), balanced instead of tokens."""

    per_tile: float = 0.0
    per_token: float = 1.0
    per_token_sq: float = 0.0

    def cost(self, vit: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        t = tokens.astype(np.float64)
        return self.per_tile * vit + self.per_token * t + self.per_token_sq * t * t

    @classmethod
    def parse(cls, text: str) -> CostModel:
        """'a,b,c' -> CostModel(a, b, c)."""
        parts = text.split(",")
        if len(parts) != 3:
            raise ValueError(f"cost model '{text}': expected three numbers 'a,b,c'")
        try:
            a, b, c = (float(p) for p in parts)
        except ValueError as exc:
            raise ValueError(f"cost model '{text}': {exc}") from exc
        if min(a, b, c) < 0 or a + b + c <= 0:
            raise ValueError(f"cost model '{text}': coefficients must be >= 0, not all zero")
        return cls(a, b, c)


def _backend(reference: bool):
    return isf_reference if reference or _core is None else _core


def permutation(n: int, seed: int, *, reference: bool = False) -> np.ndarray:
    """Fisher-Yates permutation of range(n) driven by splitmix64(seed)."""
    return np.asarray(_backend(reference).permutation(int(n), _u64(seed)), np.int64)


def _u64(seed: int) -> int:
    return int(seed) & ((1 << 64) - 1)


def pack_isf(vit: np.ndarray, tokens: np.ndarray, vit_budget: int, token_budget: int, *,
             token_threshold: int | None = None, rounds: int = 10, seed: int = 0,
             reference: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """OmniBal ISF over positions of `vit`/`tokens`: (samples, pack_ptr).

    `token_threshold` defaults to token_budget - 128 (the reference's argument search).
    """
    thresh = token_budget - 128 if token_threshold is None else int(token_threshold)
    if rounds < 1:
        raise ValueError(f"isf: rounds must be >= 1, got {rounds}")
    samples, ptr = _backend(reference).isf(
        np.asarray(vit, np.int64), np.asarray(tokens, np.int64), int(vit_budget),
        int(token_budget), thresh, int(rounds), _u64(seed))
    return np.asarray(samples, np.int64), np.asarray(ptr, np.int64)


def ratio_band(vit: np.ndarray, weight: np.ndarray) -> tuple[int, int]:
    """A low and a high weight per tile of the data (x1024, integers). The low one is how
    lightly a pack's other tiles can be filled, which decides how many tiles a heavy sample's pack
    gives up; the high one how much weight a pack short of tiles can still carry."""
    has = vit > 0
    if not has.any():
        return 0, 0
    ratio = weight[has] / vit[has]
    mean = weight[has].sum() / vit[has].sum()
    low = min(np.percentile(ratio, LOW_RATIO_PERCENTILE), mean)
    high = max(np.percentile(ratio, HIGH_RATIO_PERCENTILE), mean)
    return int(math.floor(low * 1024)), int(math.ceil(high * 1024))


def pack_slots(vit: np.ndarray, weight: np.ndarray, tokens: np.ndarray, vit_budget: int,
               token_budget: int, packs: int, *, grow: int = 0, seed: int = 0,
               passes: int = REPAIR_PASSES, band: tuple[int, int] | None = None,
               reference: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Slot balancing into `packs` packs, `grow` more at a time while the tiles do not fit:
    (samples, pack_ptr, leftover). `band` defaults to ratio_band(vit, weight)."""
    vit, weight, tokens = (np.asarray(a, np.int64) for a in (vit, weight, tokens))
    lo, hi = ratio_band(vit, weight) if band is None else band
    out = _backend(reference).slot_balance(
        vit, weight, tokens, int(vit_budget), int(token_budget), int(packs), int(grow),
        _u64(seed), int(passes), TOLERANCE_DIV, REPAIR_WINDOW, REPAIR_PARTNERS, lo, hi)
    return tuple(np.asarray(a, np.int64) for a in out)


def _weights(lengths: LengthStats, cost: CostModel | None) -> np.ndarray:
    """Integer weights balanced besides tiles: tokens, or the cost scaled to ~1e4 per sample."""
    if cost is None:
        return lengths.tokens.astype(np.int64)
    c = cost.cost(lengths.vit, lengths.tokens)
    scale = 1e4 / max(float(c.mean()), 1e-12) if len(c) else 1.0
    return np.maximum(np.rint(c * scale), 1).astype(np.int64)


def _oversize(lengths: LengthStats, vit_budget: int, token_budget: int, policy: str
              ) -> np.ndarray:
    over = (lengths.vit > vit_budget) | (lengths.tokens > token_budget)
    if policy == "error" and over.any():
        i = int(np.flatnonzero(over)[0])
        raise ValueError(
            f"sample {i} (vit_num={int(lengths.vit[i])}, token_num={int(lengths.tokens[i])}) "
            f"exceeds the budgets (vit {vit_budget}, tokens {token_budget}); {int(over.sum())} "
            "such sample(s). Raise the budgets or pass --oversize solo|skip")
    return over


def _split_to_multiple(samples: np.ndarray, ptr: np.ndarray, per_step: int,
                       tokens: np.ndarray) -> np.ndarray:
    """New pack_ptr whose pack count is a multiple of per_step (ISF makes any number of packs):
    the heaviest multi-sample packs are split in two; empty packs only if too few can be."""
    extra = -(len(ptr) - 1) % per_step
    if extra == 0:
        return ptr
    sizes = np.diff(ptr)
    load = np.bincount(np.repeat(np.arange(len(sizes)), sizes), tokens[samples], len(sizes))
    load = np.where(sizes > 1, load, -1)
    chosen = np.argsort(-load, kind="stable")[:extra]
    chosen = chosen[load[chosen] >= 0]
    cuts = ptr[chosen] + sizes[chosen] // 2
    empty = np.full(extra - len(chosen), ptr[-1])
    return np.sort(np.concatenate([ptr, cuts, empty])).astype(np.int64)


def _regular_packs(lengths: LengthStats, regular: np.ndarray, weight: np.ndarray, solo: int,
                   per_step: int, vit_budget: int, token_budget: int, seed: int, algorithm: str,
                   mode: str, isf_rounds: int, isf_threshold: int | None, reference: bool
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(samples, pack_ptr) of the packs of the regular samples, as global sample indices."""
    v, t, w = lengths.vit[regular], lengths.tokens[regular], weight[regular]
    if algorithm == "isf":
        samples, ptr = pack_isf(v, t, vit_budget, token_budget, token_threshold=isf_threshold,
                                rounds=isf_rounds, seed=seed, reference=reference)
        return regular[samples], ptr
    # Large inputs are packed in chunks of about CHUNK samples: the same quality as one
    # such chunk, in linear time. The packs fill whole steps: every chunk but the last gets the
    # packs its budgets need (the core adds packs while its tiles do not fit), the last one as
    # many more as fill the last step (the core adds steps).
    passes = REPAIR_PASSES if mode == "random" else 0
    band = ratio_band(v, w)
    k = max(1, round(len(regular) / CHUNK))
    parts = [np.arange(i, len(regular), k) for i in range(k)]  # strided: each chunk a cross-section
    out_samples, out_sizes = [], []
    placed, scale = solo, 1.0  # scale: packs the last chunk needed over its budgets' bound
    for i, part in enumerate(parts):
        pv, pt = v[part], t[part]
        bound = max(pv.sum() / vit_budget if vit_budget else 0.0, pt.sum() / token_budget, 1.0)
        need = math.ceil(bound * scale)
        last = i == len(parts) - 1
        packs = -(-(placed + need) // per_step) * per_step - placed if last else need
        for _ in range(MAX_RETRIES):
            samples, ptr, leftover = pack_slots(pv, w[part], pt, vit_budget, token_budget, packs,
                                                grow=per_step if last else 1, seed=seed + i,
                                                passes=passes, band=band, reference=reference)
            if len(leftover) == 0:
                break
            packs = len(ptr) - 1 + (per_step if last else 1)
        else:
            raise RuntimeError(f"balance: could not place all samples after {MAX_RETRIES} "
                               "attempts")
        out_samples.append(regular[part[samples]])
        out_sizes.append(np.diff(ptr))
        placed += len(ptr) - 1
        scale = (len(ptr) - 1) / bound
    sizes = np.concatenate(out_sizes)
    return (np.concatenate(out_samples).astype(np.int64),
            np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))


def _ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenation of range(starts[k], starts[k] + sizes[k]) over k."""
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offsets = np.repeat(np.cumsum(sizes) - sizes, sizes)
    return np.repeat(starts, sizes) + np.arange(total) - offsets


def balance(lengths: LengthStats, *, dp_size: int, micro_batches: int = 1, vit_budget: int,
            token_budget: int, seed: int = 0, mode: str = "random", algorithm: str = "default",
            oversize: str = "error", cost: CostModel | None = None, isf_rounds: int = 10,
            isf_threshold: int | None = None, reference: bool = False) -> BalancePlan:
    """Balance one epoch: packs of samples laid out over (step, dp rank, micro-batch).

    Deterministic for its arguments, so every DP rank can compute the same plan on its own.
    Every sample appears exactly once in `samples`, or (only with oversize='skip') `skipped`.
    """
    from megatron_omnibal.data import pack_layout

    _check_args(dp_size, micro_batches, vit_budget, token_budget, seed, mode, algorithm,
                oversize)
    per_step = dp_size * micro_batches
    over = _oversize(lengths, vit_budget, token_budget, oversize)
    regular = np.flatnonzero(~over)
    solo = np.flatnonzero(over) if oversize == "solo" else np.zeros(0, np.int64)
    skipped = np.flatnonzero(over) if oversize == "skip" else np.zeros(0, np.int64)
    weight = _weights(lengths, cost)
    samples, ptr = _regular_packs(lengths, regular, weight, len(solo), per_step, vit_budget,
                                  token_budget, seed, algorithm, mode, isf_rounds, isf_threshold,
                                  reference)
    samples = np.concatenate([samples, solo]).astype(np.int64)  # solo: one pack each
    ptr = np.concatenate([ptr, ptr[-1] + np.arange(1, len(solo) + 1)]).astype(np.int64)
    ptr = _split_to_multiple(samples, ptr, per_step, lengths.tokens)
    num = len(ptr) - 1
    sizes = np.diff(ptr)
    pack_id = np.repeat(np.arange(num), sizes)
    pack_vit = np.bincount(pack_id, lengths.vit[samples], num).astype(np.int64)
    pack_w = np.bincount(pack_id, weight[samples], num)
    names = max(len(lengths.names), 1)
    counts = np.bincount(pack_id * names + lengths.dataset[samples], minlength=num * names)
    dominant = counts.reshape(num, names).argmax(axis=1)
    step, rank, micro = pack_layout.layout(pack_vit, pack_w, dp_size, micro_batches, mode, seed,
                                           dominant)
    order = np.lexsort((micro, rank, step))
    samples = samples[_ranges(ptr[:-1][order], sizes[order])]
    ptr = np.concatenate([[0], np.cumsum(sizes[order])]).astype(np.int64)
    meta = {"vit_budget": int(vit_budget), "token_budget": int(token_budget),
            "dp": int(dp_size), "micro_batches": int(micro_batches), "seed": int(seed),
            "mode": mode, "algorithm": algorithm, "oversize": oversize,
            "num_samples": len(lengths), "version": VERSION,
            "cost": None if cost is None else [cost.per_tile, cost.per_token, cost.per_token_sq]}
    if algorithm == "isf":
        meta.update(isf_rounds=int(isf_rounds),
                    isf_threshold=int(token_budget - 128 if isf_threshold is None
                                      else isf_threshold))
    return BalancePlan(samples, ptr, step[order], rank[order], micro[order],
                       skipped.astype(np.int64), json.loads(json.dumps(meta)))


def _check_args(dp_size: int, micro_batches: int, vit_budget: int, token_budget: int,
                seed: int, mode: str, algorithm: str, oversize: str) -> None:
    from megatron_omnibal.data.pack_layout import MODES

    for name, value, low in (("dp_size", dp_size, 1), ("micro_batches", micro_batches, 1),
                             ("vit_budget", vit_budget, 0), ("token_budget", token_budget, 1),
                             ("seed", seed, 0)):
        if int(value) != value or value < low:
            raise ValueError(f"balance: {name} must be an integer >= {low}, got {value!r}")
    for name, value, allowed in (("mode", mode, MODES), ("algorithm", algorithm, ALGORITHMS),
                                 ("oversize", oversize, OVERSIZE)):
        if value not in allowed:
            raise ValueError(f"balance: unknown {name} '{value}' "
                             f"(choose from {', '.join(allowed)})")
