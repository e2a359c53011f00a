"""Model FLOPs and MFU (planner/cost_model/flops.py, megatron/training/throughput.py, the training
log's figures), checked against FLOPs counted by hand matrix multiply by matrix multiply
(tests/helpers/flops_by_hand.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_omnibal.megatron.stream.stream_steps import StepFigures, StreamSteps
from megatron_omnibal.megatron.training.throughput import Throughput
from megatron_omnibal.megatron.training.training_log import (
    IterationLog,
    first_step_line,
    step_scalars,
)
from megatron_omnibal.models.presets import PRESETS
from megatron_omnibal.planner.cost_model.device_peak import device_peak_tflops
from megatron_omnibal.planner.cost_model.flops import ModelFlops
from tests.helpers.flops_by_hand import training_flops_by_hand

TINY = PRESETS["tiny"]
# A known step: DP rank 0 packs (2 tiles, 30 tokens) and (1 tile, 9 tokens), rank 1 one
# text-only sample with a dummy tile (1 tile, 40 tokens).
RANKS = [[(2, 30), (1, 9)], [(1, 40)]]


def figures(ranks) -> StepFigures:
    def col(f):
        return np.array([sum(f(t, n) for t, n in r) for r in ranks], np.int64)

    return StepFigures(col(lambda t, n: 1), col(lambda t, n: t), col(lambda t, n: n),
                       col(lambda t, n: n * n))  # fmt: skip


# internvl3.5-38b: Qwen3-32B's heads x head size (8192) is not its hidden size (5120).
@pytest.mark.parametrize(
    "name", ["tiny", "internvl2-8b", "llava-1.5-7b", "internvl3.5-38b", "llava-llama3.1-8b"]
)
def test_model_flops_match_the_count_by_hand(name) -> None:
    spec = PRESETS[name]
    flops = ModelFlops.of(spec)
    for ranks in (RANKS, [[(0, 7)]], [[(5, 2000), (3, 500)]]):
        f = figures(ranks)
        want = sum(training_flops_by_hand(spec, r) for r in ranks)
        assert flops.training(f.tiles, f.tokens, f.sumsq).sum() == pytest.approx(want, rel=1e-12)


def test_mfu_of_a_step_against_the_hand_count() -> None:
    tp = Throughput(flops=ModelFlops.of(TINY), gpus=4, peak_tflops=0.002, peak_source="test")
    seconds = 0.25
    by_hand = sum(training_flops_by_hand(TINY, r) for r in RANKS)
    tflops, fraction = tp.rates([figures(RANKS)], seconds)
    assert tflops == pytest.approx(by_hand / seconds / 4 / 1e12, rel=1e-12)
    assert fraction == pytest.approx(by_hand / seconds / 4 / 2e9, rel=1e-12)
    # padding is not useful work: the samples (2 tiles, 30 tokens) and (1, 9) padded into one
    # of 39 tokens count exactly the hand count's extra attention, nothing else
    flops = ModelFlops.of(TINY)
    padded = training_flops_by_hand(TINY, [(3, 39)])
    assert flops.training(3, 39, 39**2) - flops.training(3, 39, 30**2 + 9**2) == pytest.approx(
        padded - training_flops_by_hand(TINY, RANKS[0]), rel=1e-12
    )


def test_peak_table_names_its_source_and_never_guesses() -> None:
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == (
        989.0, "NVIDIA H100 80GB HBM3: H100-80G preset, dense BF16")
    assert device_peak_tflops("NVIDIA A100-SXM4-40GB", "fp16")[0] == 312.0
    assert device_peak_tflops("NVIDIA H100 PCIe", "bf16")[0] is None  # other clocks
    assert device_peak_tflops("NVIDIA H100 80GB HBM3", "fp32")[0] is None
    assert device_peak_tflops(None, "bf16") == (
        None, "no GPU (give --omnibal-peak-tflops for MFU)")
    assert device_peak_tflops(None, "fp32", 123.0) == (123.0, "--omnibal-peak-tflops")


def _balanced_stream(seed: int):
    """(lengths, the balanced sampler of DP rank 0, its StreamSteps) of 60 random samples."""
    from megatron_omnibal.balance.config import BalanceConfig
    from megatron_omnibal.balance.sampler import BalancedBatchSampler
    from megatron_omnibal.data.lengths import from_arrays

    rng = np.random.default_rng(seed)
    vit = rng.integers(0, 4, 60)
    lengths = from_arrays(vit, rng.integers(10, 90, 60) + 4 * vit, vit)
    cfg = BalanceConfig(dp_size=2, micro_batches=2, vit_budget=8, token_budget=200, seed=1)
    sampler = BalancedBatchSampler(lengths, cfg, dp_rank=0)
    return lengths, sampler, StreamSteps(sampler.plan, sampler.lengths_of)


def _step_samples(sampler, step: int) -> list[np.ndarray]:
    """The samples of each pack of `step` (every DP rank) in the balanced plan's epoch 0."""
    plan = sampler.plan(0)
    return [plan.samples[plan.pack_ptr[p]:plan.pack_ptr[p + 1]]
            for p in np.flatnonzero(plan.pack_step == step)]  # fmt: skip


def _flops_by_hand(lengths, packs: list[np.ndarray]) -> float:
    return sum(training_flops_by_hand(TINY, [(int(lengths.vit[i]), int(lengths.tokens[i]))
                                             for i in s]) for s in packs)  # fmt: skip


def test_the_log_line_carries_tflops_and_mfu_and_the_first_step_the_plan() -> None:
    lengths, sampler, steps = _balanced_stream(3)
    tp = Throughput(flops=ModelFlops.of(TINY), gpus=2, peak_tflops=1e-4, peak_source="test")
    lines: list[str] = []
    log = IterationLog(steps=steps, log_interval=1, tensorboard_interval=1, is_logger=True,
                       throughput=tp, predicted_step_ms=100.0)  # fmt: skip
    log.record(1, 0.5, printer=lambda text, **_: lines.append(text))
    log.record(2, 0.25, printer=lambda text, **_: lines.append(text))
    assert len(lines) == 3  # the first-step comparison, then one line per iteration
    for it, seconds, line in ((0, 0.5, lines[1]), (1, 0.25, lines[2])):
        by_hand = _flops_by_hand(lengths, _step_samples(sampler, it))
        assert f"| model TFLOP/s/GPU {by_hand / seconds / 2 / 1e12:.3f} |" in line
        assert f"| MFU {100 * by_hand / seconds / 2 / 1e8:.1f}% |" in line
    assert lines[0].startswith("omnibal: first step measured 500.0 ms")
    assert "; plan predicted 100.0 ms" in lines[0] and lines[0].endswith("; peak: test")
    scalars = step_scalars(steps.step(0), 0.5, tp)
    assert scalars["omnibal/mfu"] == pytest.approx(tp.rates([steps.step(0)], 0.5)[1])
    no_peak = Throughput(flops=ModelFlops.of(TINY), gpus=2, peak_tflops=None, peak_source="x")
    assert no_peak.describe([steps.step(0)], 0.5).endswith("| MFU n/a")
    assert "plan predicted" not in first_step_line(no_peak, steps.step(0), 0.5, None)


def test_the_startup_summary_predicts_the_first_steps_time_and_mfu() -> None:
    """Before training, the summary states the plan's predicted step and the model TFLOP/s and
    MFU the first step's samples reach at that time (by hand); the first step's line then puts
    the measured figures beside the same prediction."""
    from megatron_omnibal.megatron.stages.layout import layout_from_counts
    from megatron_omnibal.megatron.training.training_log import startup_summary

    lengths, sampler, steps = _balanced_stream(4)
    tp = Throughput(flops=ModelFlops.of(TINY), gpus=4, peak_tflops=1e-4, peak_source="test")

    def summary(**kw):
        return startup_summary(
            layouts=tuple(layout_from_counts((4, 0), (0, 4), (1, 0), (0, 2), 4, 4)), tp=1,
            dp=2, micro_batches=2, vit_budget=8, token_budget=200, num_samples=60,
            lengths_file="l.json", source="synthetic", balancer="balancer default",
            steps=steps, start_iteration=0, **kw)  # fmt: skip

    first = _step_samples(sampler, 0)
    by_hand = _flops_by_hand(lengths, first)
    [line] = [x for x in summary(throughput=tp, predicted_step_ms=80.0) if "plan predicted" in x]
    want = (f"omnibal: plan predicted step 80.0 ms, model TFLOP/s/GPU "
            f"{by_hand / 0.08 / 4 / 1e12:.3f} | MFU {100 * by_hand / 0.08 / 4 / 1e8:.1f}% for "
            f"the first step's {sum(len(s) for s in first)} samples")  # fmt: skip
    assert line.startswith(want) and line.endswith("; peak: test")
    measured = first_step_line(tp, steps.step(0), 0.2, 80.0)
    assert measured.startswith("omnibal: first step measured 200.0 ms")
    assert f"plan predicted {want.split('plan predicted step ')[1].split(' for the')[0]};" in (
        measured)
    assert not any("plan predicted" in x for x in summary())  # no plan: no prediction
