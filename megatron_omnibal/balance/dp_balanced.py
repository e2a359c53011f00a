"""Megatron-Core's `dp_balanced` packing scheduler, as a baseline to compare plans with.

Megatron-LM's `--sequence-packing-scheduler dp_balanced` (megatron/core/datasets/
data_schedule.py, not in megatron-core 0.19) packs each global batch on its own: the batch's
samples, in the sampler's shuffled order, fill a pack until the next one would pass the maximum
sequence length (a sample longer than it is a pack of its own); while the pack count is not a
multiple of DP (times the micro-batch group of a virtual pipeline stage), the last sample of the
last pack that holds more than one moves into a pack of its own, walking back from the end (the
first pack is never split); pack k of the batch runs as micro-batch k // DP on rank k % DP, so
every rank runs as many micro-batches, a number that varies from step to step. It looks at
tokens only: a pack's image tiles (vision encoder memory and time) are whatever its samples
bring.

This is our own implementation from that description, in numpy; Megatron is never imported.
`equal_memory_max_seq_len` chooses its maximum sequence length so that its packs fit the memory
a balance plan's budgets allow, the fair ground for a comparison.
"""

from __future__ import annotations

from bisect import bisect_right

import numpy as np

from megatron_omnibal.balance.core import permutation
from megatron_omnibal.balance.plan_io import BalancePlan
from megatron_omnibal.data.lengths import LengthStats

SEQ_LEN_GRID = 64  # candidate maximum sequence lengths are multiples of this


def fill_in_order(start: int, end: int, max_seq_len: int, prefix: list[int]
                  ) -> list[list[int]]:
    """Packs of positions start..end-1 (in order) as [first, last + 1) ranges: each pack takes
    samples while their sum stays within max_seq_len, at least one. `prefix[k]` is the sum of
    the tokens of positions before k."""
    packs, at = [], start
    while at < end:
        stop = min(end, max(at + 1, bisect_right(prefix, prefix[at] + max_seq_len) - 1))
        packs.append([at, stop])
        at = stop
    return packs


def split_to_multiple(packs: list[list[int]], multiple: int) -> list[list[int]]:
    """Megatron's move: while the count is not a multiple, the last sample of the last pack
    (walking back, never the first pack) that holds more than one becomes a pack of its own,
    appended at the end. Packs are [first, last + 1) ranges; the moved ones are one wide."""
    move = -len(packs) % multiple
    out = [list(p) for p in packs]
    i = len(out) - 1
    while move > 0:
        if i <= 0:
            raise ValueError(f"dp_balanced: {len(packs)} packs of "
                             f"{sum(p[1] - p[0] for p in packs)} samples cannot be made a "
                             f"multiple of {multiple} (too few samples in the global batch)")
        if out[i][1] - out[i][0] > 1:
            out[i][1] -= 1
            out.append([out[i][1], out[i][1] + 1])
            move -= 1
        else:
            i -= 1
    return out


def step_packs(tokens: np.ndarray, samples_per_step: int, max_seq_len: int, multiple: int
               ) -> list[list[list[int]]]:
    """Per global batch: its packs as [first, last + 1) ranges over positions of `tokens` (the
    samples in training order), filled in order and split to a multiple. Batches of
    `samples_per_step`, the last one also taking the remainder."""
    n = len(tokens)
    prefix = np.concatenate([[0], np.cumsum(tokens)]).tolist()
    num_steps = max(1, n // samples_per_step)
    out = []
    for step in range(num_steps):
        start = step * samples_per_step
        end = n if step == num_steps - 1 else start + samples_per_step
        out.append(split_to_multiple(fill_in_order(start, end, max_seq_len, prefix), multiple))
    return out


def _check_sizes(dp_size: int, samples_per_step: int, max_seq_len: int, microbatch_group: int
                 ) -> None:
    if min(dp_size, samples_per_step, max_seq_len, microbatch_group) < 1:
        raise ValueError("dp_balanced: dp_size, samples_per_step, max_seq_len and "
                         "microbatch_group must be >= 1")


def dp_balanced(lengths: LengthStats, *, dp_size: int, samples_per_step: int,
                max_seq_len: int, microbatch_group: int = 1, seed: int = 0) -> BalancePlan:
    """One epoch as dp_balanced trains it: the shuffled samples cut into global batches of
    `samples_per_step` (the last one also takes the remainder, where Megatron's sampler would
    drop it: every sample is trained once), each packed and dealt as the module docstring
    says. The plan's steps have a varying number of micro-batches (meta["micro_batches"] holds
    each step's)."""
    _check_sizes(dp_size, samples_per_step, max_seq_len, microbatch_group)
    order = permutation(len(lengths), seed)
    per_step = step_packs(lengths.tokens[order], samples_per_step, max_seq_len,
                          dp_size * microbatch_group)
    counts = np.array([len(packs) for packs in per_step], np.int64)
    bounds = np.array([r for packs in per_step for r in packs], np.int64).reshape(-1, 2)
    step = np.repeat(np.arange(len(counts)), counts)
    k = np.arange(len(step)) - np.repeat(np.cumsum(counts) - counts, counts)
    rank, micro = k % dp_size, k // dp_size
    stored = np.lexsort((micro, rank, step))  # packs in (step, rank, micro) order
    bounds, step, rank, micro = bounds[stored], step[stored], rank[stored], micro[stored]
    sizes = bounds[:, 1] - bounds[:, 0]
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    at = np.repeat(bounds[:, 0] - ptr[:-1], sizes) + np.arange(int(ptr[-1]))
    return BalancePlan(order[at], ptr, step, rank, micro, np.zeros(0, np.int64),
                       meta={"dp": dp_size, "algorithm": "dp_balanced", "seed": seed,
                             "max_seq_len": max_seq_len, "samples_per_step": samples_per_step,
                             "microbatch_group": microbatch_group,
                             "micro_batches": (counts // dp_size).tolist()})


def largest_pack(plan: BalancePlan, lengths: LengthStats) -> tuple[int, int]:
    """(most tiles, most tokens) of any pack of the plan."""
    pid = np.repeat(np.arange(plan.num_packs), np.diff(plan.pack_ptr))
    tiles = np.bincount(pid, lengths.vit[plan.samples], plan.num_packs)
    tokens = np.bincount(pid, lengths.tokens[plan.samples], plan.num_packs)
    return int(tiles.max()), int(tokens.max())


def equal_memory_max_seq_len(lengths: LengthStats, *, vit_budget: int, token_budget: int,
                             dp_size: int, samples_per_step: int, microbatch_group: int = 1,
                             seed: int = 0) -> int:
    """The largest maximum sequence length (a multiple of SEQ_LEN_GRID, at most the token
    budget) whose dp_balanced packs all stay within both budgets: it packs by tokens only, so at
    the token budget its packs can hold more tiles than the vision encoder's memory allows.
    Scanned down from the token budget. A sample longer than the length is a pack of its own,
    as dp_balanced makes it (within the budgets, as every sample is); the grid's least length
    if none keeps the tiles."""
    _check_sizes(dp_size, samples_per_step, token_budget, microbatch_group)
    order = permutation(len(lengths), seed)
    tokens = lengths.tokens[order]
    tiles = np.concatenate([[0], np.cumsum(lengths.vit[order])])
    length = token_budget // SEQ_LEN_GRID * SEQ_LEN_GRID
    while length > SEQ_LEN_GRID:
        packs = np.array([r for step in step_packs(tokens, samples_per_step, length,
                                                   dp_size * microbatch_group)
                          for r in step], np.int64)
        if (tiles[packs[:, 1]] - tiles[packs[:, 0]]).max() <= vit_budget:
            return length
        length -= SEQ_LEN_GRID
    return SEQ_LEN_GRID
