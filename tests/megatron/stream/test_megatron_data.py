"""The balanced Megatron data iterator: exactly-once per epoch across DP ranks, resume positions
equal to an uninterrupted stream, collated micro-batches holding exactly the drawn samples, the
same micro-batches with 0 and 2 DataLoader workers, skipped samples dropped alike on the deciding
and the other ranks, and the model-side lengths (no Megatron process group needed)."""

import json
from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_omnibal.balance.config import BalanceConfig, Level
from megatron_omnibal.balance.sampler import BalancedBatchSampler
from megatron_omnibal.data.lengths import LengthsError, from_arrays, load_lengths
from megatron_omnibal.megatron.stream.batch import is_shape_only, synthetic_sample
from megatron_omnibal.megatron.stream.data import BalancedDataIterator, model_lengths
from megatron_omnibal.megatron.stream.iterators import filler_sample
from megatron_omnibal.megatron.stream.loader import (
    BadSampleChannel,
    BadSamplePolicy,
    MicroBatchDataset,
    SampleLoadError,
)
from megatron_omnibal.models.presets import PRESETS

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "data" / "internvl_subset.npz"
SPEC = PRESETS["tiny"]


@pytest.fixture(scope="module")
def lengths():
    """300 real records of the example data, as the tiny model sees them."""
    real = load_lengths(EXAMPLE)
    pick = np.random.default_rng(0).choice(len(real), 300, replace=False)
    return model_lengths(real.subset(np.sort(pick)), 256, SPEC.tokens_per_tile, 16)


def _sampler(lengths, dp, rank, micro=2, **kw):
    config = BalanceConfig(
        dp_size=dp, micro_batches=micro, vit_budget=24, token_budget=256, seed=5, **kw
    )
    return BalancedBatchSampler(lengths, config, dp_rank=rank)


def _dataset(lengths, pixels=False):
    return MicroBatchDataset(
        lambda i, _epoch: synthetic_sample(i, lengths, SPEC, seed=3, pixels=pixels),
        lambda: filler_sample(SPEC),
    )


def _iterator(lengths, dp, rank, start=0, micro=2, pixels=False, workers=0, **kw):
    return BalancedDataIterator(
        _sampler(lengths, dp, rank, micro, **kw),
        micro,
        _dataset(lengths, pixels),
        start_step=start,
        num_workers=workers,
    )


def _draw(it):
    next(it)
    return it.last_indices


def _epoch_steps(lengths, dp, epoch, **kw):
    sampler = _sampler(lengths, dp, 0, **kw)
    sampler.set_epoch(epoch)
    return sampler.steps_per_epoch


@pytest.mark.parametrize("dp", [1, 3])
def test_each_sample_exactly_once_per_epoch_across_dp_ranks(lengths, dp):
    """One stream per rank, read across two epochs: each epoch covers every sample once."""
    steps = [_epoch_steps(lengths, dp, e) for e in range(2)]
    epochs = [Counter(), Counter()]
    for r in range(dp):
        it = _iterator(lengths, dp, r)
        for e in range(2):
            for _ in range(steps[e] * 2):
                epochs[e].update(_draw(it))
    for e, seen in enumerate(epochs):
        assert sorted(seen) == list(range(len(lengths))), f"epoch {e}: samples lost"
        assert max(seen.values()) == 1, f"epoch {e}: samples repeated"


def test_skipped_samples_are_the_only_ones_missing(lengths):
    big = int(np.argmax(lengths.tokens))
    tokens = lengths.tokens.copy()
    tokens[big] = 10_000  # above the token budget
    data = from_arrays(lengths.vit, tokens, lengths.image_flags)
    steps = _epoch_steps(data, 2, 0, oversize="skip")
    seen = Counter()
    for rank in range(2):
        it = BalancedDataIterator(_sampler(data, 2, rank, oversize="skip"), 2, _dataset(data))
        for _ in range(steps * 2):
            seen.update(_draw(it))
    assert sorted(seen) == sorted(set(range(len(data))) - {big})
    assert max(seen.values()) == 1


@pytest.mark.parametrize("start", [0, 1, 7, 13, 40])
def test_resumed_iterator_continues_the_uninterrupted_stream(lengths, start):
    """Seeking to step k (across epochs of different lengths) == drawing k steps and going on."""
    for rank in range(2):
        whole = _iterator(lengths, 2, rank)
        expected = [_draw(whole) for _ in range((start + 6) * 2)][start * 2 :]
        resumed = _iterator(lengths, 2, rank, start=start)
        assert [_draw(resumed) for _ in range(12)] == expected


def test_collated_batch_holds_exactly_the_drawn_samples(lengths):
    it = _iterator(lengths, 2, 1, pixels=True)
    for batch in islice(it, 5):
        idx = it.last_indices
        want = [synthetic_sample(i, lengths, SPEC, seed=3) for i in idx]
        cu = batch.cu_seqlens.tolist()
        assert np.diff(cu).tolist() == [int(lengths.tokens[i]) for i in idx]
        assert torch.equal(batch.tokens[0], torch.cat([s.tokens for s in want]))
        assert torch.equal(batch.labels[0], torch.cat([s.labels for s in want]))
        assert torch.equal(batch.images, torch.cat([s.images for s in want]))
        assert int(batch.image_flags.sum()) == int(lengths.image_flags[idx].sum())


def test_micro_batches_respect_the_budgets(lengths):
    it = _iterator(lengths, 1, 0)
    for _ in range(40):
        idx = _draw(it)
        assert lengths.vit[idx].sum() <= 24 and lengths.tokens[idx].sum() <= 256


def test_model_lengths_recount_image_tokens_and_scale_text():
    data = from_arrays([1, 3, 2], [300, 800, 520], [1, 2, 2])
    got = model_lengths(data, 256, 4, 8)
    # text = tokens - 256 * real tiles -> 44, 288, 8; ceil(/8) -> 6, 36, 1 -> at least 2.
    want = [6 + 1 * 4, 36 + 2 * 4, 2 + 2 * 4]
    assert got.tokens.tolist() == want
    assert got.vit.tolist() == [1, 3, 2] and got.image_flags.tolist() == [1, 2, 2]


def test_model_lengths_reject_records_without_room_for_their_images():
    data = from_arrays([1, 2], [300, 400], [1, 2])
    with pytest.raises(LengthsError, match="length record 1: token_num 400"):
        model_lengths(data, 256, 4, 1)


class _Packs:
    """A fixed stream of packs in the sampler protocol (one epoch of `packs`, repeated)."""

    def __init__(self, packs, micro):
        self.packs, self.micro, self.pos = packs, micro, 0
        self.steps_per_epoch = len(packs) // micro
        self.last_level = self.last_epoch = 0
        self.levels = (Level(vit_budget=24, token_budget=256, micro_batches=micro),)

    def set_epoch(self, epoch):
        self.pos = 0

    def load_state_dict(self, state):
        self.pos = state["step"] * self.micro

    def __iter__(self):
        while True:
            yield self.packs[self.pos % len(self.packs)]
            self.pos += 1


def test_an_empty_pack_becomes_a_filler_without_loss_tokens(lengths):
    it = BalancedDataIterator(_Packs([[3, 4], []], 2), 2, _dataset(lengths))
    full, empty = next(it), next(it)
    assert full.num_samples == 2 and full.loss_mask.sum() > 0
    assert empty.num_samples == 1 and empty.tokens.shape == (1, 1)
    assert empty.loss_mask.sum() == 0 and empty.image_flags.tolist() == [0]


def _fields(batch):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in batch.as_dict().items()}  # fmt: skip


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


def test_workers_give_the_same_micro_batches_in_the_same_order_and_resume(lengths):
    """0 and 2 DataLoader workers: identical indices, tokens, labels, pixels, also when
    resumed in the middle of an epoch."""
    steps = _epoch_steps(lengths, 1, 0)
    start = steps // 2  # mid-epoch
    runs = {}
    for workers in (0, 2):
        it = _iterator(lengths, 1, 0, pixels=True, workers=workers)
        runs[workers] = [(list(it.last_indices), _fields(b)) for b in islice(it, 2 * (start + 3))]
        resumed = _iterator(lengths, 1, 0, start=start, pixels=True, workers=workers)
        runs[workers, "resumed"] = [(list(resumed.last_indices), _fields(b))
                                    for b in islice(resumed, 6)]
    for key in (0, 2):
        got = runs[key, "resumed"]
        want = runs[0][2 * start:]
        assert [g[0] for g in got] == [w[0] for w in want]
        for (_, a), (_, b) in zip(got, want, strict=True):
            _same(a, b)
    assert [r[0] for r in runs[2]] == [r[0] for r in runs[0]]
    for (_, a), (_, b) in zip(runs[2], runs[0], strict=True):
        _same(a, b)


def test_ranks_without_pixels_get_the_same_tokens_and_shape_only_tiles(lengths):
    with_pixels = _iterator(lengths, 2, 0, pixels=True)
    without = _iterator(lengths, 2, 0, pixels=False, workers=1)
    for a, b in islice(zip(with_pixels, without, strict=False), 6):
        assert is_shape_only(b.images) and b.images.shape == a.images.shape
        for key in ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens",
                    "image_flags"):
            assert torch.equal(getattr(a, key), getattr(b, key)), key


class _Failing(MicroBatchDataset):
    """Synthetic samples; `bad` samples fail to load (on the ranks that load pixels)."""

    def __init__(self, lengths, bad, pixels):
        def make(i, _epoch):
            if pixels and i in bad:
                raise SampleLoadError(f"sample {i}: cannot decode image x{i}.jpg")
            return synthetic_sample(i, lengths, SPEC, seed=3, pixels=pixels)

        super().__init__(make, lambda: filler_sample(SPEC))


def test_a_failed_sample_stops_the_run_or_is_skipped_alike_on_every_rank(lengths, tmp_path):
    from torch.distributed import HashStore

    stream = _iterator(lengths, 1, 0)
    first = [_draw(stream) for _ in range(6)]
    bad = {first[1][0], first[4][-1]}
    decider_it = BalancedDataIterator(_sampler(lengths, 1, 0), 2, _Failing(lengths, bad, True))
    with pytest.raises(SampleLoadError, match=f"sample {first[1][0]}: cannot decode.*skip"):
        for _ in range(6):
            next(decider_it)
    store = HashStore()
    report = tmp_path / "bad.jsonl"
    decider = BadSamplePolicy(mode="skip", decides=True, channel=BadSampleChannel(store, 0, 4),
                              report=report, describe=lambda i: f"id s{i}")
    follower = BadSamplePolicy(mode="skip", decides=False,
                               channel=BadSampleChannel(store, 0, 4))
    its = [BalancedDataIterator(_sampler(lengths, 1, 0), 2, _Failing(lengths, bad, pixels),
                                num_workers=workers, policy=policy)
           for pixels, workers, policy in ((True, 2, decider), (False, 0, follower))]
    for k in range(6):
        a, b = next(its[0]), next(its[1])  # the decider reaches micro-batch k first
        kept = [i for i in first[k] if i not in bad]
        want = [synthetic_sample(i, lengths, SPEC, seed=3) for i in kept]
        for batch in (a, b):
            assert torch.equal(batch.tokens[0], torch.cat([s.tokens for s in want]))
            assert batch.images.shape[0] == sum(len(s.images) for s in want)
        assert torch.equal(a.images, torch.cat([s.images for s in want]))
    lines = [json.loads(x) for x in report.read_text().splitlines()]
    assert sorted(e["index"] for e in lines) == sorted(bad)
    assert {e["sample"] for e in lines} == {f"id s{i}" for i in bad}
    assert decider.skipped == 2 and "2 sample(s)" in decider.summary()


LEVELS = (Level(vit_budget=5, token_budget=28, micro_batches=8),
          Level(vit_budget=24, token_budget=256, micro_batches=2))  # fmt: skip


def _level_iterator(lengths, start=0, workers=0, rank=0):
    sampler = _sampler(lengths, 2, rank, micro=2, levels=LEVELS)
    return BalancedDataIterator(sampler, 2, _dataset(lengths), start_step=start,
                                num_workers=workers)  # fmt: skip


def _steps(it, n):
    """n steps as the training loop runs them: ask the step's count, then draw that many.
    Per step: (step, count, the levels its micro-batches carry, their sample indices)."""
    out = []
    for _ in range(n):
        count = it.micro_batches_of_next_step()
        levels, indices = [], []
        for _ in range(count):
            levels.append(next(it).level)
            indices.append(list(it.last_indices))
        out.append((it.step, count, levels, indices))
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_steps_of_levels_run_their_own_micro_batches_with_the_level_in_each(lengths, workers):
    """Oracle: the sampler's own per-step level and micro-batch count. However far the loader
    draws ahead (2 workers prefetch), each step asks for and gets its level's count, and each
    micro-batch says its step's level; a stream resumed at a level change continues alike."""
    oracle = _sampler(lengths, 2, 0, micro=2, levels=LEVELS)
    total = oracle.steps_per_epoch + 3  # into the next epoch
    want = []
    for s in range(total):
        e, k = (0, s) if s < oracle.steps_per_epoch else (1, s - oracle.steps_per_epoch)
        oracle.set_epoch(e)
        want.append((s, oracle.micro_batches_of_step(k), oracle.level_of_step(k)))
    assert {lv for _, _, lv in want} == {0, 1}  # both levels occur
    got = _steps(_level_iterator(lengths, workers=workers), total)
    assert [(s, count, levels[0]) for s, count, levels, _ in got] == want
    assert all(levels == [levels[0]] * count for _, count, levels, _ in got)
    start = next(s for s in range(1, total) if want[s][2] != want[s - 1][2])
    resumed = _steps(_level_iterator(lengths, start=start, workers=workers), total - start)
    assert resumed == got[start:]


def test_next_step_count_is_refused_inside_a_step(lengths):
    it = _level_iterator(lengths)
    it.micro_batches_of_next_step()
    next(it)
    with pytest.raises(RuntimeError, match="still to be drawn"):
        it.micro_batches_of_next_step()


def test_the_level_travels_with_the_micro_batch(lengths):
    it = _level_iterator(lengths)
    batch = next(b for b in it if b.level == 1 and b.num_samples > 1)
    assert batch.to("cpu").level == 1
    from megatron_omnibal.megatron.stream.batch import MicroBatch, drop_samples

    assert MicroBatch.from_dict(batch.as_dict()).level == 1
    tiles = [int(lengths.vit[i]) for i in it.last_indices]
    assert drop_samples(batch, [0], tiles).level == 1
