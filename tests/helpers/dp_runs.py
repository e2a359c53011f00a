"""The DP=2 training run that tests in several files read (tests/conftest.py's dp2_run), and
the balanced steps per epoch of its data."""

import sys
from pathlib import Path
from types import SimpleNamespace

WORKERS = Path(__file__).resolve().parent / "megatron_workers"


def dp_epoch_steps(lengths: Path, dp: int) -> int:
    """Balanced steps per epoch of the `tiny` preset on `lengths` (2 micro-batches per rank,
    budgets 16 tiles / 160 tokens, text scale 8, seed 7: the flags of the DP runs)."""
    from megatron_omnibal.balance.config import BalanceConfig
    from megatron_omnibal.balance.sampler import BalancedBatchSampler
    from megatron_omnibal.data.lengths import load_lengths
    from megatron_omnibal.megatron.stream.data import model_lengths
    from megatron_omnibal.models.presets import PRESETS

    data = model_lengths(load_lengths(lengths), 256, PRESETS["tiny"].tokens_per_tile, 8)
    config = BalanceConfig(dp_size=dp, micro_batches=2, vit_budget=16, token_budget=160, seed=7)
    return BalancedBatchSampler(data, config, dp_rank=0).steps_per_epoch


def tiny_training_flags(lengths: Path, *extra: str) -> list[str]:
    """pretrain_vlm's flags of the `tiny` training runs (budgets 16 tiles / 160 tokens, text
    scale 8, dropout, seed 7, a `torch` checkpoint format), then `extra`."""
    return [
        "--omnibal", "--omnibal-model", "tiny", "--omnibal-lengths", str(lengths),
        "--omnibal-vit-budget", "16", "--omnibal-token-budget", "160",
        "--omnibal-text-scale", "8", "--micro-batch-size", "1", "--lr", "1e-3",
        "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--clip-grad", "0",
        "--transformer-impl", "local", "--ckpt-format", "torch", "--seed", "7",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--log-interval", "1",
        *extra,
    ]  # fmt: skip


def dp2_training(lengths: Path, out: Path) -> SimpleNamespace:
    """One epoch of DP=2 (PP=1) training of `tiny` through pretrain_vlm (train_record.py under
    torchrun) with dropout, every iteration logged, TensorBoard on and a `torch` checkpoint two
    steps before the end (the run goes on and its records are whole). `flags`: the run's own
    without the TensorBoard ones (a resume adds --load)."""
    sys.path.insert(0, str(WORKERS))
    from launch import run_ranks
    from run_records import records

    steps = dp_epoch_steps(lengths, dp=2)
    stop = steps - 2
    flags = tiny_training_flags(lengths, "--global-batch-size", "4", "--train-iters", str(steps),
                                "--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "4")
    ckpt, tb = out / "ckpt", out / "tb"
    logged = ["--tensorboard-dir", str(tb), "--tensorboard-log-interval", "1",
              "--omnibal-peak-tflops", "0.001"]  # fmt: skip
    saved = ["--save", str(ckpt), "--save-interval", str(stop)]
    code, stdout, stderr = run_ranks(WORKERS / "train_record.py", 2,
                                    [str(out / "whole"), *flags, *saved, *logged], 600)  # fmt: skip
    assert code == 0, stdout[-3000:] + stderr[-6000:]
    return SimpleNamespace(flags=flags, whole=out / "whole", ckpt=ckpt, stop=stop, steps=steps,
                           tb=tb, stdout=stdout, records=records(out / "whole"))  # fmt: skip
