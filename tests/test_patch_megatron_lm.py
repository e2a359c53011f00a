"""The shipped patch on a real Megatron-LM checkout (set MEGATRON_LM_DIR; skipped otherwise).

The checkout's committed state is cloned (shared objects, so the user's checkout is neither
touched nor copied in full), patched with scripts/apply_megatron_patch.sh, and its
pretrain_vlm.py --omnibal trains on CPU (torchrun, 2 processes, gloo, PP=2) through
scripts/launch_single_node.sh. Oracle: the same flags through the package's own entry
(python -m megatron_omnibal.pretrain_vlm) give the same losses and the same trained weights,
so the patched script hands the run over and changes nothing in it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
APPLY = ROOT / "scripts" / "apply_megatron_patch.sh"
LAUNCH = ROOT / "scripts" / "launch_single_node.sh"
EXAMPLE = ROOT / "examples" / "data" / "internvl_subset.npz"
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
TRAIN_ITERS = 3

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(
        not MEGATRON_LM_DIR,
        reason="set MEGATRON_LM_DIR to a Megatron-LM git checkout (tag core_v0.19.x) to test the "
        "patch on it; tests/test_patch_apply.py covers the apply script without one",
    ),
]


def run(cmd: list[str], timeout: int = 120, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


@pytest.fixture(scope="module")
def patched_checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clone of MEGATRON_LM_DIR's HEAD with the patch applied (checked twice: idempotent)."""
    clone = tmp_path_factory.mktemp("megatron-lm") / "Megatron-LM"
    cloned = run(["git", "clone", "-q", "--shared", str(MEGATRON_LM_DIR), str(clone)], 300)
    assert cloned.returncode == 0, cloned.stderr
    first = run(["bash", str(APPLY), str(clone)])
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Applied" in first.stdout
    second = run(["bash", str(APPLY), str(clone)])
    assert second.returncode == 0, second.stdout + second.stderr
    assert "Already applied" in second.stdout
    return clone


def test_patch_touches_only_pretrain_vlm_and_only_adds(patched_checkout: Path) -> None:
    numstat = run(["git", "-C", str(patched_checkout), "diff", "--numstat"]).stdout.split()
    added, deleted, path = numstat
    assert path == "pretrain_vlm.py" and int(added) > 0 and deleted == "0"
    source = (patched_checkout / "pretrain_vlm.py").read_text()
    compile(source, "pretrain_vlm.py", "exec")


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 real records of the shipped example data."""
    from megatron_omnibal.data.lengths import load_lengths, read_stats_config, save_lengths

    real = load_lengths(EXAMPLE)
    pick = np.sort(np.random.default_rng(1).choice(len(real), 40, replace=False))
    path = tmp_path_factory.mktemp("lengths") / "lengths.npz"
    save_lengths(real.subset(pick), path, config=read_stats_config(EXAMPLE))  # 256 per tile
    return path


def train_flags(lengths: Path, save: Path) -> list[str]:
    """A tiny VLM at PP=2 (ViT on stage 0, LLM split 1+3), a few steps, checkpoint at the end."""
    return [
        "--omnibal", "--omnibal-model", "tiny", "--omnibal-lengths", str(lengths),
        "--omnibal-vit-budget", "16", "--omnibal-token-budget", "160",
        "--omnibal-text-scale", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--pipeline-model-parallel-size", "2", "--omnibal-vit-pp-layers", "4,0",
        "--omnibal-llm-pp-layers", "1,3", "--lr", "1e-3", "--clip-grad", "0",
        "--transformer-impl", "local",
        "--ckpt-format", "torch", "--seed", "7", "--log-interval", "1",
        "--train-iters", str(TRAIN_ITERS), "--save", str(save), "--save-interval", "100",
    ]  # fmt: skip


def launch(lengths: Path, out: Path, *entry: str) -> tuple[list[float], Path]:
    """Train through the single-node launcher (CPU, 2 processes); the logged loss per
    iteration and the checkpoint directory."""
    # The venv first on PATH, as when it is activated: Megatron-LM's initialize builds the
    # checkout's dataset helpers with `make`, which calls python3 (and needs its pybind11).
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
    cmd = ["bash", str(LAUNCH), "--cpu", "--nproc-per-node", "2", *entry]
    proc = run([*cmd, *train_flags(lengths, out / "ckpt")], timeout=300, env=env, cwd=out)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    losses = [float(v) for v in re.findall(r"lm loss: ([0-9.E+-]+)", log)]
    assert len(losses) == TRAIN_ITERS, log[-3000:]
    return losses, out / "ckpt"


def load_weights(ckpt: Path) -> dict[str, np.ndarray]:
    import torch

    step = ckpt / f"iter_{TRAIN_ITERS:07d}"
    weights = {}
    for file in sorted(step.glob("mp_rank_*/model_optim_rng.pt")):
        state = torch.load(file, map_location="cpu", weights_only=False)["model"]
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                weights[f"{file.parent.name}/{name}"] = value.float().numpy()
    return weights


def test_patched_pretrain_vlm_trains_like_the_package_entry(
    patched_checkout: Path, lengths_file: Path, tmp_path: Path
) -> None:
    (tmp_path / "patched").mkdir()
    (tmp_path / "package").mkdir()
    script = str(patched_checkout / "pretrain_vlm.py")
    patched_losses, patched_ckpt = launch(lengths_file, tmp_path / "patched", "--script", script)
    package_losses, package_ckpt = launch(lengths_file, tmp_path / "package")
    assert patched_losses == package_losses
    assert all(np.isfinite(patched_losses))
    patched, package = load_weights(patched_ckpt), load_weights(package_ckpt)
    assert {name.split("/")[0] for name in patched} == {"mp_rank_00_000", "mp_rank_00_001"}
    assert patched.keys() == package.keys()
    for name, value in patched.items():
        np.testing.assert_array_equal(value, package[name], err_msg=name)


def test_patched_pretrain_vlm_without_the_package_fails_clearly(patched_checkout: Path) -> None:
    """--omnibal where megatron_omnibal cannot be imported (hidden through sys.modules): a
    one-line error and exit status 1, no traceback, before any Megatron import."""
    script = str(patched_checkout / "pretrain_vlm.py")
    hide_and_run = (
        "import runpy, sys; sys.modules['megatron_omnibal'] = None; "
        f"sys.argv = [{script!r}, '--omnibal']; runpy.run_path({script!r}, run_name='__main__')"
    )
    proc = run([sys.executable, "-c", hide_and_run])
    assert proc.returncode == 1
    assert proc.stderr.strip() == (
        "pretrain_vlm.py: --omnibal needs the megatron-omnibal package installed"
    )


def test_patched_vlm_arguments_list_the_omnibal_flags(patched_checkout: Path) -> None:
    """The script's own argument group gains the --omnibal* flags for --help. (Megatron 0.19's
    full --help cannot show it: argparse fails on an unescaped '%' in the help of
    --moe-paged-stash-buffer-size-factor-cuda, in every Megatron script.)"""
    show_help = (
        "import argparse, sys\n"
        "from megatron_omnibal.megatron.cpu import enable_cpu_megatron\n"
        "enable_cpu_megatron()  # Python 3.11: typing.override for megatron.training\n"
        f"sys.path.insert(0, {str(patched_checkout)!r})\n"
        "import pretrain_vlm\n"
        "print(pretrain_vlm.add_vlm_extra_args(argparse.ArgumentParser()).format_help())\n"
    )
    proc = run([sys.executable, "-c", show_help], cwd=patched_checkout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for flag in ("--freeze-LM", "--omnibal", "--omnibal-plan", "--omnibal-vit-pp-layers"):
        assert re.search(rf"^\s+{re.escape(flag)}\b", proc.stdout, re.MULTILINE), flag
