"""dp_balanced (Megatron-Core's packing scheduler, our implementation) against a plain
transcription of its description, on small random inputs; its invariants; the equal-memory
maximum sequence length against a scan of every length."""

import numpy as np
import pytest

from megatron_omnibal.balance.core import permutation
from megatron_omnibal.balance.dp_balanced import (
    SEQ_LEN_GRID,
    dp_balanced,
    equal_memory_max_seq_len,
    largest_pack,
)
from megatron_omnibal.data.lengths import from_arrays


def reference_batch(seqlens: list[int], max_len: int, multiple: int) -> list[list[int]]:
    """One global batch, sample by sample: fill until the next would pass max_len; then, while
    the count is not a multiple, pop the last sample of the last pack with more than one (walking
    back, never pack 0) into a pack of its own at the end."""
    packs, current, total = [], [], 0
    for i, length in enumerate(seqlens):
        if total + length <= max_len:
            current.append(i)
            total += length
        else:
            if current:
                packs.append(current)
            current, total = [i], length
    if current:
        packs.append(current)
    move, i = -len(packs) % multiple, len(packs) - 1
    while move > 0:
        assert i > 0
        if len(packs[i]) > 1:
            packs.append([packs[i].pop()])
            move -= 1
        else:
            i -= 1
    return packs


def reference_plan(tokens: np.ndarray, dp: int, per_step: int, max_len: int, group: int,
                   seed: int) -> dict[tuple[int, int, int], list[int]]:
    """(step, rank, micro) -> samples, pack k of a step on rank k % dp as micro k // dp."""
    order = permutation(len(tokens), seed)
    steps = max(1, len(tokens) // per_step)
    out = {}
    for s in range(steps):
        ids = order[s * per_step:len(tokens) if s == steps - 1 else (s + 1) * per_step]
        for k, pack in enumerate(reference_batch([int(tokens[i]) for i in ids], max_len,
                                                 dp * group)):
            out[(s, k % dp, k // dp)] = [int(ids[j]) for j in pack]
    return out


def _lengths(rng, n):
    vit = rng.integers(1, 8, n)
    return from_arrays(vit, vit * 64 + rng.integers(1, 900, n))


@pytest.mark.parametrize("case", range(12))
def test_dp_balanced_matches_the_reference(case):
    rng = np.random.default_rng(case)
    n = int(rng.integers(40, 300))
    dp, group = int(rng.integers(1, 5)), int(rng.integers(1, 3))
    lengths = _lengths(rng, n)
    per_step = int(rng.integers(dp * group * 3, max(dp * group * 3 + 1, n // 2)))
    max_len = int(rng.integers(int(lengths.tokens.max()) - 300, 4000))
    plan = dp_balanced(lengths, dp_size=dp, samples_per_step=per_step, max_seq_len=max_len,
                       microbatch_group=group, seed=case)
    want = reference_plan(lengths.tokens, dp, per_step, max_len, group, case)
    got = {(int(plan.pack_step[p]), int(plan.pack_rank[p]), int(plan.pack_micro[p])):
           plan.pack(p).tolist() for p in range(plan.num_packs)}
    assert got == want
    # every sample once; packs within max_len unless one sample alone passes it
    assert np.array_equal(np.sort(plan.samples), np.arange(n)) and len(plan.skipped) == 0
    pid = np.repeat(np.arange(plan.num_packs), np.diff(plan.pack_ptr))
    tokens = np.bincount(pid, lengths.tokens[plan.samples], plan.num_packs)
    assert ((tokens <= max_len) | (np.diff(plan.pack_ptr) == 1)).all()
    # a whole number of micro-batch groups per step, every rank the same micro-batches
    per = np.bincount(plan.pack_step)
    assert (per % (dp * group) == 0).all()
    assert list(per // dp) == plan.meta["micro_batches"]
    keys = plan.pack_step * 10**6 + plan.pack_rank * 10**3 + plan.pack_micro
    assert (np.diff(keys) > 0).all()  # stored in (step, rank, micro) order, no duplicates


def test_too_few_samples_for_the_multiple_is_an_error():
    lengths = from_arrays(np.ones(3, np.int64), np.full(3, 100))
    with pytest.raises(ValueError, match="multiple of 8"):
        dp_balanced(lengths, dp_size=8, samples_per_step=3, max_seq_len=1000)


def test_equal_memory_length_is_the_largest_that_keeps_both_budgets():
    """Against every grid length: the chosen one keeps the tile budget, each longer one up to
    the token budget breaks it."""
    rng = np.random.default_rng(3)
    lengths = _lengths(rng, 400)
    kw = dict(dp_size=4, samples_per_step=60, seed=1)
    vb, tb = 14, 3008
    chosen = equal_memory_max_seq_len(lengths, vit_budget=vb, token_budget=tb, **kw)
    assert chosen % SEQ_LEN_GRID == 0 and chosen <= tb
    tiles, tokens = largest_pack(dp_balanced(lengths, max_seq_len=chosen, **kw), lengths)
    assert tiles <= vb and tokens <= max(chosen, int(lengths.tokens.max())) <= tb
    for longer in range(chosen + SEQ_LEN_GRID, tb + 1, SEQ_LEN_GRID):
        assert largest_pack(dp_balanced(lengths, max_seq_len=longer, **kw), lengths)[0] > vb
