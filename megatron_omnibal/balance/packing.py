"""Packs of one level: samples into packs within (vit_budget, token_budget), a multiple of the
packs of one step, by the slot-balancing core or by OmniBal's ISF.

Large inputs are packed in strided chunks of about CHUNK samples (each chunk a cross-section of
the data): the same quality as one such chunk, in linear time. What the layout needs of each pack
(tiles, tokens, modeled time, dominant dataset) is summed there too, from the chunk's arrays
(in cache) rather than by a gather across the whole data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_omnibal.balance import core, histograms
from megatron_omnibal.balance.checks import pack_sums

CHUNK = 80_000   # samples packed together (larger inputs: chunks of this size)
MAX_RETRIES = 64
LPT_GROWTH = 32  # token balancing short of room retries with at least 1/32 more packs


@dataclass(frozen=True)
class PackStats:
    """Per pack: tiles, tokens, modeled time (ms, summed in sample order from 0.0, as
    np.bincount sums it) and most frequent dataset (the smallest on ties)."""

    vit: np.ndarray
    tokens: np.ndarray
    time: np.ndarray
    dataset: np.ndarray

    @staticmethod
    def of(samples: np.ndarray, ptr: np.ndarray, vit: np.ndarray, tokens: np.ndarray,
           ms: np.ndarray, dataset: np.ndarray, datasets: int) -> PackStats:
        """The stats of packs (samples, ptr) over positions of the per-sample arrays."""
        num = len(ptr) - 1
        pack_id = np.repeat(np.arange(num), np.diff(ptr))
        v, t = pack_sums(np.stack([vit, tokens], axis=1), samples, ptr).T
        return PackStats(v, t, np.bincount(pack_id, ms[samples], num),
                         histograms.most_frequent(pack_id, dataset[samples], num, datasets))

    @staticmethod
    def concat(parts: list[PackStats]) -> PackStats:
        return PackStats(*(np.concatenate([getattr(p, f) for p in parts])
                           for f in ("vit", "tokens", "time", "dataset")))


@dataclass(frozen=True)
class Packs:
    """Packs as positions into the arrays they were made from: pack p is
    samples[ptr[p]:ptr[p+1]]; `stats` per pack."""

    samples: np.ndarray
    ptr: np.ndarray
    stats: PackStats


def big(vit: np.ndarray, tokens: np.ndarray, vit_budget: int, token_budget: int) -> np.ndarray:
    """Samples over half a budget: no two of them share a pack (for integers, 2x > b is
    x > b // 2: no doubled copies)."""
    vit, tokens = np.asarray(vit), np.asarray(tokens)
    if vit.dtype.kind in "iu" and tokens.dtype.kind in "iu":
        return (vit > int(vit_budget) // 2) | (tokens > int(token_budget) // 2)
    return (2 * vit > vit_budget) | (2 * tokens > token_budget)


def packs_needed(vit: np.ndarray, tokens: np.ndarray, vit_budget: int, token_budget: int
                 ) -> int:
    """A lower bound on the packs: totals over budgets, and one pack per sample over half of a
    budget (two of them never share one)."""
    if len(vit) == 0:
        return 0
    alone = int(big(vit, tokens, vit_budget, token_budget).sum())
    bound = max(vit.sum() / vit_budget if vit_budget else 0.0, tokens.sum() / token_budget)
    return max(alone, math.ceil(bound), 1)


def split_to_multiple(samples: np.ndarray, ptr: np.ndarray, per_step: int,
                      tokens: np.ndarray, offset: int = 0) -> np.ndarray:
    """New pack_ptr whose pack count plus `offset` is a multiple of per_step (ISF makes any
    number of packs): the heaviest multi-sample packs are split in two; empty packs only if too
    few can be."""
    extra = -(len(ptr) - 1 + offset) % per_step
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


def pack_level(vit: np.ndarray, tokens: np.ndarray, weight2: np.ndarray, optional: np.ndarray,
               ms: np.ndarray, dataset: np.ndarray, *, datasets: int, vit_budget: int,
               token_budget: int, per_step: int, algorithm: str, repair: bool, seed: int,
               isf_rounds: int, isf_threshold: int, min_packs: int = 0, offset: int = 0,
               use_reference: bool = False) -> Packs:
    """Pack every sample whose `optional` flag is off into packs (at least `min_packs`) whose
    count plus `offset` (packs of this level made elsewhere) is a multiple of `per_step`;
    optional samples (GreedyFill's top-up) go where there is room, the others are left out.
    Tokens are balanced, `weight2` (the modeled time) beside them. Every sample must fit the
    budgets on its own. `ms` (modeled time) and `dataset` (of `datasets`) only go into the
    packs' stats."""
    n = len(vit)
    if n == 0:
        empty = np.zeros(0, np.int64)
        count = -(-(max(min_packs, 0) + offset) // per_step) * per_step - offset
        ptr = np.zeros(count + 1, np.int64)
        return Packs(empty, ptr, PackStats.of(empty, ptr, vit, tokens, ms, dataset, datasets))
    if algorithm == "isf":
        samples, ptr = core.pack_isf(vit, tokens, vit_budget=vit_budget,
                                     token_budget=token_budget, threshold=isf_threshold,
                                     rounds=isf_rounds, seed=seed, use_reference=use_reference)
        ptr = split_to_multiple(samples, ptr, per_step, tokens, offset)
        short = max(min_packs - (len(ptr) - 1), 0)
        short = -(-short // per_step) * per_step
        ptr = np.concatenate([ptr, np.full(short, ptr[-1])]).astype(np.int64)
        return Packs(samples, ptr, PackStats.of(samples, ptr, vit, tokens, ms, dataset, datasets))
    # Tokens bind before tiles (full packs would hold more tiles than the tokens leave room
    # for): tiles follow the tokens, packs are balanced by tokens alone (core.pack_lpt, which
    # uses no tokens-per-tile band).
    by_tokens = int(tokens.sum()) * vit_budget > int(vit.sum()) * token_budget
    band = (0, 0) if by_tokens else core.ratio_band(vit, tokens)
    k = max(1, round(n / CHUNK))
    out_samples, out_sizes, out_stats, filled = np.empty(n, np.int64), [], [], 0
    placed, scale = offset, 1.0  # scale: packs the last chunk needed over its budgets' bound
    for i in range(k):
        part = slice(i, n, k)  # strided: each chunk a cross-section (no gathers)
        # copied once into contiguous arrays: every later pass over a strided view would touch
        # a cache line per sample
        pv, pt, pw2 = (np.ascontiguousarray(a[part], np.int64) for a in (vit, tokens, weight2))
        opt = optional[part]
        some_optional = bool(opt.any())
        bound = max(packs_needed(*((pv[~opt], pt[~opt]) if some_optional else (pv, pt)),
                                 vit_budget, token_budget), 1)
        need = math.ceil(bound * scale)
        last = i == k - 1
        if last:
            need = max(need, min_packs + offset - placed)
            packs = -(-(placed + need) // per_step) * per_step - placed
        else:
            packs = need
        # With optional samples the core adds no packs itself (they must not cost a step):
        # what finds no slot comes back, and missing packs are added here.
        grow = 0 if some_optional else per_step if last else 1
        for _ in range(MAX_RETRIES):
            params = core.slot_params(vit_budget=vit_budget, token_budget=token_budget,
                                      packs=packs, grow=grow, seed=seed + i,
                                      band=band, repair=repair, use_reference=use_reference)
            if by_tokens:
                samples, ptr, leftover = core.pack_lpt(pv, pt, params,
                                                       use_reference=use_reference)
            else:
                samples, ptr, leftover = core.pack_slots(pv, pt, pw2, pt, params,
                                                         use_reference=use_reference)
            lost = leftover[~opt[leftover]]
            if len(lost) == 0:
                break
            # as many more packs as the samples without room need (each retry is a full pass);
            # token balancing fills every pack evenly, so it needs a share more packs instead
            more = packs_needed(pv[lost], pt[lost], vit_budget, token_budget)
            if by_tokens:
                more = max(more, -(-packs // LPT_GROWTH))
            packs = len(ptr) - 1 + (-(-more // per_step) * per_step if last else more)
        else:
            raise RuntimeError(f"balance: could not place all samples after {MAX_RETRIES} "
                               "attempts")
        out_samples[filled:filled + len(samples)] = samples * k + i  # chunk position -> input
        filled += len(samples)
        out_sizes.append(np.diff(ptr))
        out_stats.append(PackStats.of(samples, ptr, pv, pt, np.ascontiguousarray(ms[part]),
                                      np.ascontiguousarray(dataset[part]), datasets))
        placed += len(ptr) - 1
        scale = (len(ptr) - 1) / bound
    sizes = np.concatenate(out_sizes)
    return Packs(out_samples[:filled], np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
                 PackStats.concat(out_stats))
