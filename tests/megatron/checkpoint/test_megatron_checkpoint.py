"""Checkpoints and the training log through `megatron_omnibal.pretrain_vlm` (torchrun, gloo).

- Megatron's default `torch_dist` format saves (its writer needs psutil) and resumes at other
  layouts: PP=2 -> PP=4 with the ViT moved onto two stages, and PP=2 -> TP=2 x PP=2. Oracle: the
  uninterrupted PP=2 run. Every parameter, by its model-wide name, equals the saved run's as the
  resumed step starts, and the resumed steps read the same samples with the same losses.
- A `torch` checkpoint at another layout, and a resume on another data stream, stop every rank
  before any process group with exit status 2 and a message naming both sides.
- `--omnibal-allow-data-change` starts a new epoch plan at the checkpoint's sample count (oracle:
  the balanced sampler itself, and the saved run's own records).
- A DP=2 run's text log and TensorBoard scalars (read back with tensorboard's EventAccumulator)
  report each step's samples, tiles and tokens, per DP rank, as the ranks really read them (the
  run: tests/conftest.py's dp2_run, which test_megatron_training.py reads too).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.balance.sampler import BalancedBatchSampler
from megatron_omnibal.data.lengths import load_lengths
from megatron_omnibal.megatron.stream.data import model_lengths
from megatron_omnibal.models.presets import PRESETS

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_ranks  # noqa: E402
from run_records import head_micro as _head_micro  # noqa: E402
from run_records import params as _params  # noqa: E402
from run_records import records as _records  # noqa: E402

from tests.helpers.flops_by_hand import training_flops_by_hand  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "megatron_workers" / "train_record.py"
EXAMPLE = ROOT / "examples" / "data" / "internvl_subset.npz"
ITERS, SAVED = 4, 2  # the source run trains ITERS steps and is resumed from iteration SAVED
MICRO = 2  # micro-batches per step (DP = 1)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """The tiny preset with a vocabulary of 256, which pads to 256 rows at TP=1 and TP=2 alike
    (128 would pad to 256 at TP=2, and the output layer could not be resharded)."""
    spec = PRESETS["tiny"].to_dict()
    spec["llm"]["vocab_size"] = 256
    path = tmp_path_factory.mktemp("model") / "tiny256.json"
    path.write_text(json.dumps(spec))
    return path


def _flags(lengths_file, model, *extra):
    return [
        "--omnibal", "--omnibal-model", str(model), "--omnibal-lengths", str(lengths_file),
        "--omnibal-vit-budget", "16", "--omnibal-token-budget", "160",
        "--omnibal-text-scale", "8", "--micro-batch-size", "1", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
        "--transformer-impl", "local", "--seed", "7", "--log-interval", "1",
        # No dropout: Megatron seeds each pipeline rank differently, so dropout masks differ
        # between layouts; the comparison is of the model state, not of RNG streams.
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(ITERS),
        *extra,
    ]  # fmt: skip


PP2 = ["--pipeline-model-parallel-size", "2", "--omnibal-vit-pp-layers", "4,0",
       "--omnibal-llm-pp-layers", "1,3", "--global-batch-size", str(MICRO)]  # fmt: skip


def _run(nproc, out, flags, params_at=None, timeout=600):
    env = {"RECORD_PARAMS_AT_STEP": str(params_at)} if params_at is not None else None
    code, stdout, stderr = run_ranks(WORKER, nproc, [str(out), *flags], timeout, env)
    return SimpleNamespace(code=code, stdout=stdout, stderr=stderr, out=Path(out))


def _ok(run):
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return run


@pytest.fixture(scope="module")
def source(lengths_file, model_file, tmp_path_factory):
    """PP=2 (ViT on stage 0), default checkpoint format, saved at iteration 2 and 4; the
    parameters as iteration 3 starts (= the state saved at iteration 2) recorded."""
    out = tmp_path_factory.mktemp("source")
    ckpt = out / "ckpt"
    flags = _flags(lengths_file, model_file, *PP2, "--save", str(ckpt), "--save-interval",
                   str(SAVED))  # fmt: skip
    run = _ok(_run(2, out / "run", flags, params_at=SAVED))
    return SimpleNamespace(run=run, ckpt=ckpt, records=_records(run.out))


def test_default_checkpoint_format_is_torch_dist_and_saves(source):
    """The documented --save without --ckpt-format: Megatron's torch_dist, whose writer needs
    psutil; both iterations are on disk as distributed checkpoints."""
    assert (source.ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    for it in (SAVED, ITERS):
        assert (source.ckpt / f"iter_{it:07d}" / "metadata.json").is_file()
    assert "in torch_dist format" in source.run.stdout


def _check_resumed_steps(source, resumed):
    """The resumed steps read the saved run's samples and give its losses."""
    want = _head_micro(source.records)[MICRO * SAVED :]
    got = _head_micro(resumed)
    assert [m["indices"] for m in got] == [m["indices"] for m in want]
    assert [m["tokens"] for m in got] == [m["tokens"] for m in want]
    assert sum(m["tokens"] for m in got) > 0
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-5)


def test_torch_dist_resumes_at_pp4_with_the_vit_moved_onto_two_stages(
    source, lengths_file, model_file, tmp_path
):
    flags = _flags(lengths_file, model_file, "--pipeline-model-parallel-size", "4",
                   "--omnibal-vit-pp-layers", "2,2,0,0", "--omnibal-llm-pp-layers", "0,0,2,2",
                   "--global-batch-size", str(MICRO), "--load", str(source.ckpt),
                   "--ckpt-step", str(SAVED))  # fmt: skip
    run = _ok(_run(4, tmp_path / "pp4", flags, params_at=SAVED))
    saved, saved_stage = _params(source.run.out)
    loaded, loaded_stage = _params(run.out)
    assert loaded.keys() == saved.keys()
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    # ViT layers 2-3 and the projector were on stage 0 and are on stage 1 now; by the flags,
    # nothing else moved from stage 0 to stage 1.
    moved = {n for n in saved if (saved_stage[n], loaded_stage[n]) == (0, 1)}
    assert moved
    _check_resumed_steps(source, _records(run.out))


def test_torch_dist_resumes_at_tp2(source, lengths_file, model_file, tmp_path):
    """TP=2 x PP=2 with another split (ViT over both stages, the LLM on the second): the
    resumed steps read the same samples and give the same losses (the model state and the
    optimizer state were resharded)."""
    flags = _flags(lengths_file, model_file, "--tensor-model-parallel-size", "2",
                   "--pipeline-model-parallel-size", "2", "--omnibal-vit-pp-layers", "2,2",
                   "--omnibal-llm-pp-layers", "0,4", "--global-batch-size", str(MICRO),
                   "--load", str(source.ckpt), "--ckpt-step", str(SAVED))  # fmt: skip
    run = _ok(_run(4, tmp_path / "tp2", flags))
    _check_resumed_steps(source, _records(run.out))


def _refused(run, message):
    """Every rank stopped; rank 0 alone printed the error, once."""
    assert run.code != 0
    errors = [line for line in run.stderr.splitlines() if line.startswith("pretrain_vlm: error:")]
    assert len(errors) == 1, run.stderr[-3000:]
    assert message in errors[0], errors[0]
    assert "initializing torch distributed" not in run.stdout
    assert not list(run.out.glob("rank*.json"))
    return errors[0]


def test_torch_checkpoint_at_another_layout_is_refused_before_any_process_group(
    source, lengths_file, model_file, tmp_path
):
    """Convert the saved iteration to the `torch` format (Megatron's --ckpt-convert-format, at
    the saved layout), then resume it at PP=4: every rank stops with the reason (in Megatron,
    the ranks without a file printed "could not load the checkpoint" and exited 0, the others
    failed inside the load)."""
    conv = tmp_path / "conv"
    flags = _flags(lengths_file, model_file, *PP2, "--load", str(source.ckpt), "--ckpt-step",
                   str(SAVED), "--ckpt-convert-format", "torch", "--ckpt-convert-save",
                   str(conv))  # fmt: skip
    _ok(_run(2, tmp_path / "convert", flags))
    torch_ckpt = conv / "torch"
    assert (torch_ckpt / f"iter_{SAVED:07d}" / "mp_rank_00_001" / "model_optim_rng.pt").is_file()
    other = _flags(lengths_file, model_file, "--pipeline-model-parallel-size", "4",
                   "--omnibal-vit-pp-layers", "2,2,0,0", "--omnibal-llm-pp-layers", "0,0,2,2",
                   "--global-batch-size", str(MICRO), "--load", str(torch_ckpt))  # fmt: skip
    error = _refused(_run(4, tmp_path / "refused", other, timeout=300),
                     f"iteration {SAVED} is a 'torch' checkpoint saved at TP=1, PP=2 (ViT layers "
                     "4+0, LLM layers 1+3); this run has TP=1, PP=4 (ViT layers 2+2+0+0, LLM "
                     "layers 0+0+2+2)")  # fmt: skip
    assert "--ckpt-convert-format torch_dist" in error


def test_resume_on_another_data_stream_is_refused_naming_both_values(
    source, lengths_file, model_file, tmp_path
):
    flags = _flags(lengths_file, model_file, *PP2, "--load", str(source.ckpt),
                   "--omnibal-token-budget", "200")  # fmt: skip
    flags[flags.index("--seed") + 1] = "8"
    error = _refused(_run(2, tmp_path / "refused", flags, timeout=300),
                     f"iteration {ITERS} was trained on another data stream")
    assert "token_budget: checkpoint 160, this run 200" in error
    assert "seed: checkpoint 7, this run 8" in error
    assert "--omnibal-allow-data-change" in error


def _consumed(stdout):
    """Megatron's "consumed samples" per logged iteration."""
    pattern = r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+)"
    return {int(i): int(c) for i, c in re.findall(pattern, stdout)}


def test_allowed_data_change_starts_a_new_epoch_plan_at_the_checkpoint_sample_count(
    source, lengths_file, model_file, tmp_path
):
    """Another token budget with --omnibal-allow-data-change: the resumed steps read the first
    steps of the new balancer's epoch ceil(consumed / samples), and consumed samples (which
    count samples, not micro-batches) go on from the checkpoint's."""
    flags = _flags(lengths_file, model_file, *PP2, "--load", str(source.ckpt), "--ckpt-step",
                   str(SAVED), "--omnibal-token-budget", "200",
                   "--omnibal-allow-data-change")  # fmt: skip
    run = _ok(_run(2, tmp_path / "changed", flags))
    saved_micro = source.records[0]["micro"][: MICRO * SAVED]
    consumed = sum(len(m["indices"]) for m in saved_micro)
    assert _consumed(source.run.stdout)[SAVED] == consumed  # samples, not the 4 packs
    epoch = math.ceil(consumed / 40)
    assert f"iteration {SAVED + 1} starts epoch {epoch} of a new balanced plan" in run.stdout
    data = model_lengths(load_lengths(lengths_file), 256, PRESETS["tiny"].tokens_per_tile, 8)
    config = BalanceConfig(dp_size=1, micro_batches=MICRO, vit_budget=16, token_budget=200,
                           seed=7)  # fmt: skip
    sampler = BalancedBatchSampler(data, config, dp_rank=0)
    sampler.set_epoch(epoch)
    stream = iter(sampler)
    want = [next(stream) for _ in range(MICRO * (ITERS - SAVED))]
    got = _records(run.out)
    for rank in (0, 1):
        assert got[rank]["start"] == SAVED
        assert [m["indices"] for m in got[rank]["micro"]] == want
    logged = _consumed(run.stdout)
    for it in range(SAVED + 1, ITERS + 1):
        consumed += sum(len(b) for b in want[MICRO * (it - SAVED - 1) : MICRO * (it - SAVED)])
        assert logged[it] == consumed


def _oracle_steps(records, lengths_file):
    """Per step, per DP rank: (samples, tiles, tokens) of the micro-batches each rank read."""
    data = model_lengths(load_lengths(lengths_file), 256, PRESETS["tiny"].tokens_per_tile, 8)
    by_dp = {r["dp_rank"]: r["micro"] for r in records.values()}
    steps = len(by_dp[0]) // MICRO
    out = []
    for s in range(steps):
        ranks = []
        for dp in sorted(by_dp):
            idx = [i for m in by_dp[dp][MICRO * s : MICRO * (s + 1)] for i in m["indices"]]
            ranks.append((len(idx), int(data.vit[idx].sum()), int(data.tokens[idx].sum())))
        out.append(np.array(ranks, dtype=np.float64))  # [dp, (samples, tiles, tokens)]
    return out


def test_training_log_and_tensorboard_report_what_each_rank_trained(dp2_run, lengths_file):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = _oracle_steps(dp2_run.records, lengths_file)
    n = dp2_run.steps
    assert len(steps) == n >= 3
    acc = EventAccumulator(str(dp2_run.tb), size_guidance={"scalars": 0})
    acc.Reload()

    def scalar(name):
        events = acc.Scalars(f"omnibal/{name}")
        assert [e.step for e in events] == list(range(1, n + 1)), name
        return np.array([e.value for e in events])

    np.testing.assert_allclose(scalar("samples-per-step"), [s[:, 0].sum() for s in steps])
    np.testing.assert_allclose(scalar("tiles-per-step"), [s[:, 1].sum() for s in steps])
    np.testing.assert_allclose(scalar("tokens-per-step"), [s[:, 2].sum() for s in steps])
    for col, kind in ((1, "tiles"), (2, "tokens")):
        np.testing.assert_allclose(scalar(f"rank-{kind}-max"), [s[:, col].max() for s in steps])
        np.testing.assert_allclose(scalar(f"rank-{kind}-mean"), [s[:, col].mean() for s in steps])
        np.testing.assert_allclose(scalar(f"rank-{kind}-max-over-mean"),
                                   [s[:, col].max() / s[:, col].mean() for s in steps],
                                   rtol=1e-6)  # fmt: skip
    tokens_per_s, samples_per_s = scalar("tokens-per-second"), scalar("samples-per-second")
    assert (tokens_per_s > 0).all()
    per_sample = [s[:, 2].sum() / s[:, 0].sum() for s in steps]
    np.testing.assert_allclose(tokens_per_s / samples_per_s, per_sample, rtol=1e-5)

    log = dp2_run.stdout
    consumed = np.cumsum([s[:, 0].sum() for s in steps])
    assert _consumed(log) == {i + 1: int(c) for i, c in enumerate(consumed)}
    lines = re.findall(r"omnibal: iteration\s+(\d+) \| samples/step ([\d.]+) \| tiles/step "
                       r"([\d.]+) \| tokens/step ([\d.]+) \| per-rank tokens max ([\d.]+) mean "
                       r"([\d.]+) \(max/mean ([\d.]+)\)", log)  # fmt: skip
    assert [int(x[0]) for x in lines] == list(range(1, n + 1))
    for (_, samples, tiles, tokens, top, mean, ratio), s in zip(lines, steps, strict=True):
        assert (float(samples), float(tiles), float(tokens)) == tuple(s.sum(axis=0))
        assert (float(top), float(mean)) == (s[:, 2].max(), s[:, 2].mean())
        assert float(ratio) == pytest.approx(s[:, 2].max() / s[:, 2].mean(), abs=1e-4)
    # model TFLOP/s per GPU and MFU (peak 0.001 TFLOP/s given): FLOPs counted by hand from the
    # samples each rank read, over the step time the tokens/s figure implies
    rates = re.findall(r"\| tokens/s ([\d.]+) .*\| model TFLOP/s/GPU ([\d.]+) \| MFU ([\d.]+)%",
                       log)  # fmt: skip
    assert len(rates) == n
    for (tok_s, tflops, share), flops, s in zip(rates, _hand_flops(dp2_run.records, lengths_file),
                                                steps, strict=True):  # fmt: skip
        seconds = s[:, 2].sum() / float(tok_s)
        assert float(tflops) == pytest.approx(flops / seconds / 2 / 1e12, rel=0.02, abs=1e-3)
        assert float(share) == pytest.approx(100 * flops / seconds / 2 / 1e9, rel=0.02, abs=0.1)
    np.testing.assert_allclose(scalar("mfu"), scalar("model-tflops-per-gpu") / 0.001, rtol=1e-6)
    assert "omnibal: first step measured" in log and "peak: --omnibal-peak-tflops" in log


def _hand_flops(records, lengths_file):
    """Training FLOPs of each step over every DP rank, counted by hand from the samples read."""
    data = model_lengths(load_lengths(lengths_file), 256, PRESETS["tiny"].tokens_per_tile, 8)
    by_dp = {r["dp_rank"]: r["micro"] for r in records.values()}
    return [sum(training_flops_by_hand(PRESETS["tiny"], [(int(data.vit[i]), int(data.tokens[i]))
                                                          for m in micro[MICRO * k:MICRO * (k + 1)]
                                                          for i in m["indices"]])
                for micro in by_dp.values())
            for k in range(len(by_dp[0]) // MICRO)]  # fmt: skip


def test_startup_summary_states_layout_budgets_and_the_epoch_plan(dp2_run, lengths_file):
    data = model_lengths(load_lengths(lengths_file), 256, PRESETS["tiny"].tokens_per_tile, 8)
    config = BalanceConfig(dp_size=2, micro_batches=MICRO, vit_budget=16, token_budget=160,
                           seed=7)  # fmt: skip
    sampler = BalancedBatchSampler(data, config, dp_rank=0)
    plan = sampler.plan(0)
    per_step = np.bincount(plan.pack_step, np.diff(plan.pack_ptr), plan.num_steps).astype(int)
    log = dp2_run.stdout
    assert log.count("omnibal: pipeline: TP=1, PP=1, DP=2, 2 micro-batches per step") == 1
    assert ("omnibal: stage 0: patch embedding, ViT layers 0-3 (recompute 0), projector, LLM "
            "embedding, LLM layers 0-3 (recompute 0), head") in log  # fmt: skip
    assert "omnibal: budgets per micro-batch: 16 image tiles, 160 tokens" in log
    epoch = (f"omnibal: epoch 0: {sampler.steps_per_epoch} steps, samples per step mean "
             f"{per_step.mean():.1f} (min {per_step.min()}, max {per_step.max()})")  # fmt: skip
    assert epoch in log
    assert "omnibal: balance over DP ranks per step (max/mean, 1.0 = perfect): tokens" in log
