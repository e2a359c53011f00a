"""Real training through `megatron_omnibal.pretrain_vlm` (torchrun, gloo, several processes):
resume after a stop gives the losses of an uninterrupted run, DP ranks read every sample
exactly once per epoch, and bad input stops every rank with a clear error before any process
group exists."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.data.lengths import load_lengths, read_stats_config, save_lengths

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "megatron_workers" / "train_record.py"
EXAMPLE = ROOT / "examples" / "data" / "internvl_subset.npz"


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory):
    """40 real records of the example data: a few balanced steps per epoch."""
    real = load_lengths(EXAMPLE)
    pick = np.sort(np.random.default_rng(1).choice(len(real), 40, replace=False))
    path = tmp_path_factory.mktemp("lengths") / "lengths.npz"
    save_lengths(real.subset(pick), path, config=read_stats_config(EXAMPLE))  # 256 per tile
    return path


def _flags(lengths_file, *extra):
    return [
        "--omnibal", "--omnibal-model", "tiny", "--omnibal-lengths", str(lengths_file),
        "--omnibal-vit-budget", "16", "--omnibal-token-budget", "160",
        "--omnibal-text-scale", "8", "--micro-batch-size", "1", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--clip-grad", "0",
        "--transformer-impl", "local", "--ckpt-format", "torch", "--seed", "7",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--log-interval", "1",
        *extra,
    ]  # fmt: skip


def _torchrun(nproc, out, flags, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(WORKER), str(out), *flags]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _records(out):
    return {json.loads(p.read_text())["rank"]: json.loads(p.read_text())
            for p in sorted(Path(out).glob("rank*.json"))}  # fmt: skip


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_resume_after_stop_continues_with_the_uninterrupted_losses(lengths_file, tmp_path):
    """PP=2 with a stage-1 recompute and dropout: run `total` steps; stop a second run after
    `stop` (--exit-interval saves and exits), resume it from the checkpoint to `total`: the
    resumed steps read the same samples and give the same per-micro-batch losses (optimizer, LR
    schedule, RNG and data position all restored). `stop` lies in the sampler's second epoch."""
    stop = _epoch_steps(lengths_file, dp=1) + 1
    total = stop + 2
    common = _flags(lengths_file, "--pipeline-model-parallel-size", "2",
                    "--omnibal-vit-pp-layers", "4,0", "--omnibal-llm-pp-layers", "1,3",
                    "--omnibal-llm-recompute", "0,2", "--global-batch-size", "2",
                    "--train-iters", str(total))  # fmt: skip
    ckpt = tmp_path / "ckpt"
    _ok(_torchrun(2, tmp_path / "whole", common))
    _ok(_torchrun(2, tmp_path / "stopped", [*common, "--save", str(ckpt), "--save-interval",
                                            "1000", "--exit-interval", str(stop)]))  # fmt: skip
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(stop)
    _ok(_torchrun(2, tmp_path / "resumed", [*common, "--load", str(ckpt)]))

    whole, stopped, resumed = (_records(tmp_path / n) for n in ("whole", "stopped", "resumed"))
    k = 2 * stop  # micro-batches before the stop
    for rank in (0, 1):
        assert stopped[rank]["start"] == 0 and resumed[rank]["start"] == stop
        w, s, r = whole[rank]["micro"], stopped[rank]["micro"], resumed[rank]["micro"]
        assert len(w) == 2 * total and len(s) == k and len(r) == 2 * total - k
        assert [m["indices"] for m in s + r] == [m["indices"] for m in w]
    last = 1  # the head stage computes the losses
    w, s, r = whole[last]["micro"], stopped[last]["micro"], resumed[last]["micro"]
    assert sum(m["tokens"] for m in r) > 0
    assert [m["tokens"] for m in r] == [m["tokens"] for m in w[k:]]
    assert [m["loss"] for m in s] == pytest.approx([m["loss"] for m in w[:k]], rel=1e-6)
    assert [m["loss"] for m in r] == pytest.approx([m["loss"] for m in w[k:]], rel=1e-6)


def _epoch_steps(lengths_file, dp):
    from megatron_omnibal.balance.config import BalanceConfig
    from megatron_omnibal.balance.sampler import BalancedBatchSampler
    from megatron_omnibal.megatron.data import model_lengths
    from megatron_omnibal.models.presets import PRESETS

    data = model_lengths(load_lengths(lengths_file), 256, PRESETS["tiny"].tokens_per_tile, 8)
    config = BalanceConfig(dp_size=dp, micro_batches=2, vit_budget=16, token_budget=160, seed=7)
    sampler = BalancedBatchSampler(data, config, dp_rank=0)
    return sampler.steps_per_epoch


@pytest.fixture(scope="module")
def dp_run(lengths_file, tmp_path_factory):
    """One epoch of DP=2 (PP=1) training with dropout, checkpointed two steps before its end
    (--save-interval without --exit-interval: the run goes on and its records are whole)."""
    steps = _epoch_steps(lengths_file, dp=2)
    stop = steps - 2
    flags = _flags(lengths_file, "--global-batch-size", "4", "--train-iters", str(steps),
                   "--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "4")  # fmt: skip
    out = tmp_path_factory.mktemp("dp")
    ckpt = out / "ckpt"
    _ok(_torchrun(2, out / "whole", [*flags, "--save", str(ckpt), "--save-interval", str(stop)]))
    return flags, out / "whole", ckpt, stop


def test_data_parallel_ranks_train_each_sample_once_per_epoch(lengths_file, dp_run):
    """DP=2 (PP=1): over one epoch of real training steps the two ranks' micro-batches hold
    every sample exactly once, and each rank's loss counts exactly its samples' loss tokens."""
    _, whole, _, _ = dp_run
    records = _records(whole)
    assert sorted(r["dp_rank"] for r in records.values()) == [0, 1]
    seen = Counter(i for r in records.values() for m in r["micro"] for i in m["indices"])
    assert sorted(seen) == list(range(40)) and max(seen.values()) == 1
    from megatron_omnibal.megatron.batch import synthetic_sample
    from megatron_omnibal.megatron.data import model_lengths
    from megatron_omnibal.models.presets import PRESETS

    spec = PRESETS["tiny"]
    data = model_lengths(load_lengths(lengths_file), 256, spec.tokens_per_tile, 8)
    for r in records.values():
        for m in r["micro"]:
            want = sum(int((synthetic_sample(i, data, spec, 7).labels >= 0).sum())
                       for i in m["indices"])  # fmt: skip
            assert m["tokens"] == want


def test_data_parallel_resume_with_dropout_continues_with_the_uninterrupted_losses(
    dp_run, tmp_path
):
    """DP=2 with dropout: resuming from the checkpoint two steps before the end gives both ranks
    the uninterrupted run's samples and losses. The ranks' micro-batches differ in shape, so
    their dropout RNG streams diverge; each must resume with its own RNG state (rank 1 would
    differ on the first resumed step) and the all-reduced update must match (both ranks on the
    second)."""
    flags, whole, ckpt, stop = dp_run
    _ok(_torchrun(2, tmp_path / "resumed", [*flags, "--load", str(ckpt), "--ckpt-step",
                                            str(stop)]))  # fmt: skip
    w, r = _records(whole), _records(tmp_path / "resumed")
    for rank in (0, 1):
        assert r[rank]["start"] == stop
        tail = w[rank]["micro"][2 * stop :]
        got = r[rank]["micro"]
        assert len(got) == len(tail) == 4
        assert [m["indices"] for m in got] == [m["indices"] for m in tail]
        assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in tail], rel=1e-6)


def test_bad_layout_stops_both_torchrun_ranks_without_a_hang(lengths_file, tmp_path):
    """Under torchrun every rank refuses the layout itself and exits; nobody waits in a
    collective (tests/test_megatron_training_args.py covers the other bad inputs)."""
    flags = _flags(lengths_file, "--pipeline-model-parallel-size", "2", "--global-batch-size",
                   "2", "--train-iters", "2", "--omnibal-vit-pp-layers", "4,0",
                   "--omnibal-llm-pp-layers", "1,2")  # fmt: skip
    proc = _torchrun(2, tmp_path / "bad", flags, timeout=90)
    assert proc.returncode != 0
    message = "pretrain_vlm: error: pipeline layout: llm layers add up to 3 over 2 stages"
    assert proc.stderr.count(message) == 2, proc.stderr[-3000:]
    assert "initializing torch distributed" not in proc.stdout
    assert not list((tmp_path / "bad").glob("rank*.json"))
