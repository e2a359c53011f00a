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


def fill_in_order(tokens: list[int], start: int, end: int, max_seq_len: int,
                  prefix: list[int]) -> list[list[int]]:
    """Packs of positions start..end-1 (in order) as [first, last + 1) ranges: each pack takes
    samples while their sum stays within max_seq_len, at least one. `prefix[k]` is the sum of
    tokens[:k]."""
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


def dp_balanced(lengths: LengthStats, *, dp_size: int, samples_per_step: int,
                max_seq_len: int, microbatch_group: int = 1, seed: int = 0) -> BalancePlan:
    """One epoch as dp_balanced trains it: the shuffled samples cut into global batches of
    `samples_per_step` (the last one also takes the remainder, where Megatron's sampler would
    drop it: every sample is trained once), each packed and dealt as the module docstring
    says. The plan's steps have a varying number of micro-batches
    (meta["micro_batches"] holds each step's)."""
    n = len(lengths)
    if dp_size < 1 or samples_per_step < 1 or max_seq_len < 1 or microbatch_group < 1:
        raise ValueError("dp_balanced: dp_size, samples_per_step, max_seq_len and "
                         "microbatch_group must be >= 1")
    multiple = dp_size * microbatch_group
    order = permutation(n, seed)
    tokens = lengths.tokens[order].tolist()
    prefix = np.concatenate([[0], np.cumsum(lengths.tokens[order])]).tolist()
    ranges, steps, ranks, micros, per_step = [], [], [], [], []
    num_steps = max(1, n // samples_per_step)
    for step in range(num_steps):
        start = step * samples_per_step
        end = n if step == num_steps - 1 else start + samples_per_step
        packs = split_to_multiple(fill_in_order(tokens, start, end, max_seq_len, prefix),
                                  multiple)
        k = np.arange(len(packs))
        ranges += packs
        steps.append(np.full(len(packs), step))
        ranks.append(k % dp_size)
        micros.append(k // dp_size)
        per_step.append(len(packs) // dp_size)
    bounds = np.array(ranges, np.int64).reshape(-1, 2)
    step, rank, micro = (np.concatenate(x).astype(np.int64) for x in (steps, ranks, micros))
    stored = np.lexsort((micro, rank, step))  # packs in (step, rank, micro) order
    bounds, step, rank, micro = bounds[stored], step[stored], rank[stored], micro[stored]
    sizes = bounds[:, 1] - bounds[:, 0]
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    at = np.repeat(bounds[:, 0] - ptr[:-1], sizes) + np.arange(int(ptr[-1]))
    return BalancePlan(order[at], ptr, step, rank, micro, np.zeros(0, np.int64),
                       meta={"dp": dp_size, "algorithm": "dp_balanced", "seed": seed,
                             "max_seq_len": max_seq_len, "samples_per_step": samples_per_step,
                             "microbatch_group": microbatch_group,
                             "micro_batches": per_step})


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
    budget, at least the longest sample) whose dp_balanced packs all stay within both budgets:
    it packs by tokens only, so at the token budget its packs can hold more tiles than the
    vision encoder's memory allows. Scanned down from the token budget; at the lower end
    (packs of one sample over the tile budget: no length helps) the longest sample's length."""
    longest = int(lengths.tokens.max())
    top = token_budget // SEQ_LEN_GRID * SEQ_LEN_GRID
    for length in range(top, longest - 1, -SEQ_LEN_GRID):
        plan = dp_balanced(lengths, dp_size=dp_size, samples_per_step=samples_per_step,
                           max_seq_len=length, microbatch_group=microbatch_group, seed=seed)
        if largest_pack(plan, lengths)[0] <= vit_budget:
            return length
    return longest
