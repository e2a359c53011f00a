"""balance(): one epoch's packs laid out over (step, dp rank, micro-batch), from a BalanceConfig.

Packers (packing.py over the C++ core, csrc/balance_core.cpp; reference.py is its Python
mirror):

- `isf`: OmniBal's Iterative Sampling and Filtering, faithfully: shuffle, fill packs in order
  until the next sample would exceed a budget, keep the full packs (tiles == tile budget or
  tokens >= threshold), re-shuffle and re-pack the others, for `isf_rounds` rounds, keeping the
  last round as it is. Unlike the reference it never drops a sample: oversize samples follow
  the oversize policy and the last open pack is kept.
- `default` (slot balancing): the pack count is a whole number of steps from the start; each
  pack's tile slots are chosen so its tiles hit the target exactly, then samples are dealt into
  slots of their tile count so that every pack carries the same tokens, and a swap repair evens
  out what is left. Samples too heavy for a full pack start packs that give up tiles instead of
  going over on tokens.

With levels (hierarchy.py) every level is packed on its own, longest first, its packs topped
up with shorter samples; each level's packs form whole steps of that level. The layout
(layout.py) forms the steps. The plan is checked (checks.py) before it is returned.
"""

from __future__ import annotations

import numpy as np

from megatron_omnibal.balance import hierarchy, layout
from megatron_omnibal.balance.checks import check_plan
from megatron_omnibal.balance.config import (
    DEFAULT_COST,
    ISF_THRESHOLD_MARGIN,
    BalanceConfig,
    PackCost,
)
from megatron_omnibal.balance.core import permutation
from megatron_omnibal.balance.packing import Packs, PackStats, big, pack_level, packs_needed
from megatron_omnibal.balance.plan_io import PLAN_VERSION, BalancePlan, ranges
from megatron_omnibal.data.lengths import LengthStats

# The packers' output version: raised whenever balance() gives other packs or another layout
# for the same lengths and config, so that a checkpoint trained on an older stream is not
# resumed into a newer one at the same iteration (megatron/stream/data_identity.py records it).
# 3: knapsack-composed tile slots, token-bound levels by LPT, the modeled time repaired.
# 4: video frame counts and frames drawn from their own streams (data/frames.py): other
#    per-epoch lengths, so other packs, and other frames trained.
# 5: the random layout measures packs against the packs within the budgets (oversize='solo'
#    packs left out of the level): another layout where solo packs exist.
# 6: the random layout gives the lightest packs steps of their own too (layout.light_packs),
#    grouped with the heavy ones by nearest_groups: another layout where packs are light in
#    tokens or modeled time.
PACKER_VERSION = 6

_TOP_UP_SALT = 0x544F505550  # "TOPUP"


def _oversize(lengths: LengthStats, config: BalanceConfig) -> np.ndarray:
    over = (lengths.vit > config.vit_budget) | (lengths.tokens > config.token_budget)
    if config.oversize == "error" and over.any():
        i = int(np.flatnonzero(over)[0])
        raise ValueError(
            f"sample {i} (vit_num={int(lengths.vit[i])}, token_num={int(lengths.tokens[i])}) "
            f"exceeds the budgets (vit {config.vit_budget}, tokens {config.token_budget}); "
            f"{int(over.sum())} such sample(s). Raise the budgets or pass --oversize solo|skip")
    return over


def sample_ms(lengths: LengthStats, cost: PackCost | None) -> np.ndarray:
    """Each sample's modeled time by the config's cost, else DEFAULT_COST (computed once: the
    packer weighs it, the layout sums it per pack)."""
    return (cost or DEFAULT_COST).sample_ms(lengths.vit, lengths.tokens)


def time_weight(ms: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The samples' modeled times `ms` as integers in units of a token on average: the
    packer's second weight, balanced beside tokens."""
    total = float(ms.sum())
    scale = float(tokens.sum()) / total if total > 0 else 0.0
    return np.rint(ms * scale).astype(np.int64)


def _level_packs(lengths: LengthStats, config: BalanceConfig, ms: np.ndarray,
                 regular: np.ndarray, solo: np.ndarray, use_reference: bool) -> list[Packs]:
    """Per level (ascending): its packs, as global sample indices; solo packs of oversize
    samples join the top level."""
    levels = config.all_levels
    vit, tok, ds = lengths.vit, lengths.tokens, lengths.dataset
    datasets = max(len(lengths.names), 1)
    time = time_weight(ms, tok)
    level_of = np.full(len(lengths), -1, np.int16)
    every = len(regular) == len(lengths)  # no oversize sample: views, no copies
    level_of[regular] = hierarchy.assign_levels(*((vit, tok) if every else
                                                  (vit[regular], tok[regular])), levels)
    # Pools of samples not yet packed, per level, in a seeded random order (GreedyFill's order).
    order = permutation(len(lengths), config.seed ^ _TOP_UP_SALT) if len(levels) > 1 else None
    pending = np.zeros(len(lengths), bool)
    pending[regular] = True
    none = np.zeros(0, np.int64)
    out = [Packs(none, np.zeros(1, np.int64),
                 PackStats.of(none, np.zeros(1, np.int64), none, none, ms[:0], none, datasets))
           for _ in levels]
    for lv in range(len(levels) - 1, -1, -1):
        level = levels[lv]
        own = np.flatnonzero(pending & (level_of == lv))
        extra = solo if lv == len(levels) - 1 else np.zeros(0, np.int64)
        if len(own) == 0 and len(extra) == 0:
            continue
        per_step = config.dp_size * level.micro_batches
        whole = len(own) == len(lengths)  # every sample, in order: no copies
        own_v, own_t = (vit, tok) if whole else (vit[own], tok[own])
        need = packs_needed(own_v, own_t, level.vit_budget, level.token_budget)
        packs = -(-(need + len(extra)) // per_step) * per_step - len(extra)
        fill = np.zeros(0, np.int64)
        if lv > 0 and len(own):
            free_v = packs * level.vit_budget - float(own_v.sum())
            free_t = packs * level.token_budget - float(own_t.sum())
            pools = [order[pending[order] & (level_of[order] == j)] for j in range(lv - 1, -1, -1)]
            budgets = (level.vit_budget, level.token_budget)
            big_room = packs - int(big(own_v, own_t, *budgets).sum())
            fill = hierarchy.top_up(pools, vit, tok, free_v, free_t, big_room, budgets)
        del own_v, own_t
        members = np.concatenate([own, fill]).astype(np.int64, copy=False)
        optional = np.concatenate([np.zeros(len(own), bool), np.ones(len(fill), bool)])
        threshold = (config.threshold if lv == len(levels) - 1
                     else level.token_budget - ISF_THRESHOLD_MARGIN)
        got = pack_level(*((vit, tok, time) if whole else
                           (vit[members], tok[members], time[members])), optional,
                         *((ms, ds) if whole else (ms[members], ds[members])),
                         datasets=datasets, vit_budget=level.vit_budget,
                         token_budget=level.token_budget,
                         per_step=per_step, algorithm=config.algorithm,
                         repair=config.mode == "random", seed=config.seed + 7919 * lv,
                         isf_rounds=config.isf_rounds, isf_threshold=threshold,
                         min_packs=packs, offset=len(extra), use_reference=use_reference)
        samples = got.samples if whole else members[got.samples]
        ptr, stats = got.ptr, got.stats
        del members, optional, got
        pending[slice(None) if whole else samples] = False
        if len(extra):  # one sample a pack: its own figures (a time summed from 0.0, as bincount)
            samples = np.concatenate([samples, extra]).astype(np.int64, copy=False)
            ptr = np.concatenate([ptr, ptr[-1] + np.arange(1, len(extra) + 1)]).astype(np.int64)
            stats = PackStats.concat([stats, PackStats(vit[extra], tok[extra], ms[extra] + 0.0,
                                                       ds[extra].astype(np.int64))])
        out[lv] = Packs(samples, ptr, stats)
    if pending.any():  # pack_level places every non-optional sample; this cannot happen
        raise RuntimeError(f"balance: {int(pending.sum())} samples were not packed")
    return out


def _lay_out(config: BalanceConfig, lv: int, stats: PackStats
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step within the level, rank, micro) of each of one level's packs (layout.layout)."""
    level = config.all_levels[lv]
    vit, tokens = stats.vit, stats.tokens
    solo = (vit > level.vit_budget) | (tokens > level.token_budget)  # only oversize='solo' packs
    return layout.layout(vit, tokens, stats.time, config.dp_size, level.micro_batches,
                         config.mode, config.seed + lv, stats.dataset,
                         None if config.algorithm == "isf" else config.tail_tolerance, solo)


def balance(lengths: LengthStats, config: BalanceConfig, *, use_reference: bool = False
            ) -> BalancePlan:
    """Balance one epoch: packs of samples laid out over (step, dp rank, micro-batch).

    Deterministic for (lengths, config), so every DP rank can compute the same plan on its own.
    Every sample appears exactly once in `samples`, or (only with oversize='skip') `skipped`;
    every pack keeps its level's budgets (a 'solo' oversize sample is a pack of its own).
    """
    if not isinstance(config, BalanceConfig):
        raise TypeError(f"balance: expected a BalanceConfig, got {type(config).__name__}")
    over = _oversize(lengths, config)
    regular = np.flatnonzero(~over)
    solo = np.flatnonzero(over) if config.oversize == "solo" else np.zeros(0, np.int64)
    skipped = np.flatnonzero(over) if config.oversize == "skip" else np.zeros(0, np.int64)
    ms = sample_ms(lengths, config.cost)
    per_level = _level_packs(lengths, config, ms, regular, solo, use_reference)
    del over, regular, solo
    levels = config.all_levels
    laid = [_lay_out(config, lv, packs.stats) for lv, packs in enumerate(per_level)]
    per_level = [(packs.samples, packs.ptr) for packs in per_level]  # the stats are done with
    del ms
    steps = [int(step.max()) + 1 if len(step) else 0 for step, _, _ in laid]
    step_level = hierarchy.interleave(steps, config.curriculum_steps, config.seed)
    # Packs in (step, rank, micro) order: each pack's place counted from where its step starts.
    step_micro = np.array([level.micro_batches for level in levels], np.int64)[step_level]
    step_start = np.concatenate([[0], np.cumsum(config.dp_size * step_micro)]).astype(np.int64)
    num_packs = int(step_start[-1])
    g_step, g_rank, g_micro, g_level, sizes = (np.zeros(num_packs, np.int64) for _ in range(5))
    places = []
    for lv, ((step, rank, micro), (_, ptr)) in enumerate(zip(laid, per_level, strict=True)):
        g = np.flatnonzero(step_level == lv)[step]
        place = step_start[g] + rank * levels[lv].micro_batches + micro
        g_step[place], g_rank[place], g_micro[place], g_level[place] = g, rank, micro, lv
        sizes[place] = np.diff(ptr)
        places.append(place)
    del laid
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    samples = np.empty(int(ptr[-1]), np.int64)
    for (level_samples, level_ptr), place in zip(per_level, places, strict=True):
        samples[ranges(ptr[place], np.diff(level_ptr))] = level_samples
    del per_level, places
    meta = dict(config.to_dict(), num_samples=len(lengths), version=PLAN_VERSION,
                packer_version=PACKER_VERSION,
                dp=config.dp_size, level_steps=steps)
    plan = BalancePlan(samples, ptr, g_step, g_rank, g_micro, skipped.astype(np.int64), meta,
                       g_level)
    check_plan(plan, lengths)
    return plan
