"""Per-step figures of the balanced stream and the training log built on them
(megatron/stream/stream_steps.py, megatron/training/training_log.py), without Megatron.

Oracle: each DP rank's own BalancedBatchSampler, read micro-batch by micro-batch as the
training iterator reads it, summed per step; TensorBoard files read back with tensorboard's own
EventAccumulator."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.balance.sampler import BalancedBatchSampler
from megatron_omnibal.data.lengths import from_arrays
from megatron_omnibal.megatron.stages.layout import layout_from_counts
from megatron_omnibal.megatron.stream.data_identity import StreamOrigin
from megatron_omnibal.megatron.stream.stream_steps import StreamSteps
from megatron_omnibal.megatron.training.training_log import (
    IterationLog,
    startup_summary,
    step_scalars,
)

rng = np.random.default_rng(11)
N = 90
VIT = rng.integers(0, 7, N)
LENGTHS = from_arrays(VIT, rng.integers(30, 400, N) + 16 * VIT, np.minimum(VIT, 1) * VIT)
DP, MICRO = 3, 2
KW = dict(dp_size=DP, micro_batches=MICRO, vit_budget=16, token_budget=512, seed=5)


def sampler(rank):
    return BalancedBatchSampler(LENGTHS, BalanceConfig(**KW), dp_rank=rank)


def oracle(first_epoch, steps):
    """[steps, dp, (samples, tiles, tokens, sum of squared tokens)] as each rank's sampler
    yields its micro-batches."""
    out = np.zeros((steps, DP, 4), np.int64)
    for rank in range(DP):
        s = sampler(rank)
        s.set_epoch(first_epoch)
        stream = iter(s)
        for step in range(steps):
            idx = [i for _ in range(MICRO) for i in next(stream)]
            tokens = LENGTHS.tokens[idx]
            out[step, rank] = (len(idx), LENGTHS.vit[idx].sum(), tokens.sum(), (tokens**2).sum())
    return out


def test_every_step_matches_what_each_rank_reads_across_epochs():
    steps = StreamSteps(sampler(0).plan, sampler(0).lengths_of)
    per_epoch = sampler(0).steps_per_epoch
    total = 2 * per_epoch + 3
    want = oracle(0, total)
    for it in range(total):
        got = steps.step(it)
        np.testing.assert_array_equal(
            np.stack([got.samples, got.tiles, got.tokens, got.sumsq], 1), want[it]
        )
    assert steps.locate(per_epoch + 1) == (1, 1)
    consumed = np.concatenate([[0], np.cumsum(want[:, :, 0].sum(axis=1))])
    assert [steps.consumed_samples(i) for i in range(total + 1)] == consumed.tolist()
    assert steps.consumed_samples(per_epoch) == N  # an epoch trains every sample once


def test_a_stream_with_an_origin_counts_from_it():
    origin = StreamOrigin(iteration=7, epoch=3, consumed_samples=1000)
    steps = StreamSteps(sampler(0).plan, sampler(0).lengths_of, origin)
    want = oracle(3, 5)
    for k in range(5):
        np.testing.assert_array_equal(steps.step(7 + k).tokens, want[k, :, 2])
        assert steps.consumed_samples(7 + k + 1) == 1000 + want[: k + 1, :, 0].sum()
    assert steps.locate(7) == (3, 0)
    with pytest.raises(ValueError, match="before the stream's origin"):
        steps.step(6)


def test_step_scalars_and_the_text_line_average_over_the_log_interval():
    steps = StreamSteps(sampler(0).plan, sampler(0).lengths_of)
    lines = []
    log = IterationLog(steps=steps, log_interval=2, tensorboard_interval=1, is_logger=True)
    log.record(1, 0.5, printer=lambda text, **_: lines.append(text))
    assert lines == []
    log.record(2, 1.5, printer=lambda text, **_: lines.append(text))
    a, b = steps.step(0), steps.step(1)
    assert len(lines) == 1 and lines[0].startswith(" omnibal: iteration        2 |")
    assert f"| epoch 0 step 2/{sampler(0).steps_per_epoch} |" in lines[0]
    assert f"samples/step {(a.num_samples + b.num_samples) / 2:.1f}" in lines[0]
    assert f"tokens/s {(a.num_tokens + b.num_tokens) / 2.0:.1f}" in lines[0]
    top = (a.tokens.max() + b.tokens.max()) / 2
    assert f"per-rank tokens max {top:.1f}" in lines[0]
    scalars = step_scalars(a, 0.5)
    assert scalars["omnibal/tokens-per-second"] == a.num_tokens / 0.5
    assert scalars["omnibal/rank-tiles-max-over-mean"] == a.tiles.max() / a.tiles.mean()
    silent = IterationLog(steps=steps, log_interval=1, tensorboard_interval=1, is_logger=False)
    silent.record(1, 0.5, printer=lambda text, **_: lines.append(text))
    assert len(lines) == 1


def test_tensorboard_scalars_read_back_with_tensorboards_event_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    steps = StreamSteps(sampler(0).plan, sampler(0).lengths_of)
    writer = SummaryWriter(str(tmp_path))
    log = IterationLog(steps=steps, log_interval=10, tensorboard_interval=2, is_logger=True)
    for it in range(1, 7):
        log.record(it, 0.25 * it, writer=writer, printer=lambda *a, **k: None)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    want = {it: step_scalars(steps.step(it - 1), 0.25 * it) for it in (2, 4, 6)}
    assert set(acc.Tags()["scalars"]) == set(want[2])
    for name in want[2]:
        events = acc.Scalars(name)
        assert [e.step for e in events] == [2, 4, 6]
        np.testing.assert_allclose([e.value for e in events], [want[i][name] for i in (2, 4, 6)],
                                   rtol=1e-6)  # fmt: skip


def test_startup_summary_names_layout_budgets_epoch_and_resume_position():
    steps = StreamSteps(sampler(0).plan, sampler(0).lengths_of)
    per_epoch = sampler(0).steps_per_epoch
    lines = startup_summary(
        layouts=tuple(layout_from_counts((3, 1), (0, 4), (1, 0), (0, 2), 4, 4)),
        tp=2, dp=DP, micro_batches=MICRO, vit_budget=16, token_budget=512, num_samples=N,
        lengths_file="l.json", source="synthetic", balancer="balancer default",
        steps=steps, start_iteration=per_epoch + 2,
    )  # fmt: skip
    text = "\n".join(lines)
    assert "omnibal: pipeline: TP=2, PP=2, DP=3, 2 micro-batches per step" in text
    assert "omnibal: stage 0: patch embedding, ViT layers 0-2 (recompute 1)\n" in text
    assert ("omnibal: stage 1: ViT layers 3-3 (recompute 0), projector, LLM embedding, LLM "
            "layers 0-3 (recompute 2), head") in text  # fmt: skip
    assert f"omnibal: epoch 1: {sampler(0).plan(1).num_steps} steps" in text
    consumed = steps.consumed_samples(per_epoch + 2)
    assert (f"omnibal: resuming at iteration {per_epoch + 2}: epoch 1, step 2 of the balanced "
            f"plan, {consumed} samples consumed") in text  # fmt: skip


def test_expert_load_in_the_line_and_tensorboard_scalars():
    """Two MoE layers of 4 experts per step: the busiest expert, the mean per expert and
    max/mean of the worst layer and over the layers, by hand; averaged over the log interval."""
    steps = StreamSteps(sampler(0).plan, sampler(0).lengths_of)
    lines, scalars = [], {}

    class Writer:
        def add_scalar(self, name, value, it):
            scalars[(name, it)] = value

    log = IterationLog(steps=steps, log_interval=2, tensorboard_interval=1, is_logger=True)
    first = np.array([[10, 10, 10, 10], [25, 5, 5, 5]])  # mean 10; max/mean 1.0 and 2.5
    second = np.array([[12, 4, 4, 4], [6, 6, 6, 6]])  # mean 6; max/mean 2.0 and 1.0
    for it, tokens in ((1, first), (2, second)):
        log.record(it, 0.5, writer=Writer(), printer=lambda text, **_: lines.append(text),
                   expert_tokens=tokens)  # fmt: skip
    assert scalars[("omnibal/expert-tokens-max", 1)] == 25
    assert scalars[("omnibal/expert-tokens-mean", 1)] == 10
    assert scalars[("omnibal/expert-tokens-max-over-mean", 1)] == 2.5
    assert scalars[("omnibal/expert-tokens-max-over-mean-layers-mean", 1)] == 1.75
    assert scalars[("omnibal/expert-tokens-max-over-mean", 2)] == 2.0
    assert len(lines) == 1
    assert ("| expert tokens max 18.5 mean 8.0 (max/mean 2.2500 worst layer, 1.6250 over "
            "layers) |") in lines[0]  # fmt: skip
    dense = IterationLog(steps=steps, log_interval=1, tensorboard_interval=1, is_logger=True)
    dense.record(1, 0.5, printer=lambda text, **_: lines.append(text))
    assert "expert" not in lines[-1]
