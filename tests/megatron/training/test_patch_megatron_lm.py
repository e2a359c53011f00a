"""The shipped patch on a real Megatron-LM checkout (set MEGATRON_LM_DIR; skipped otherwise).

The checkout's committed state is cloned (shared objects, so the user's checkout is neither
touched nor copied in full), patched with scripts/apply_megatron_patch.sh, and its
pretrain_vlm.py --omnibal trains on CPU (torchrun, 2 processes, gloo, PP=2) through
scripts/launch_single_node.sh. Oracle: the same flags through the package's own entry
(python -m megatron_omnibal.pretrain_vlm), uninterrupted, give the same losses and the same
saved tensors, so the patched script hands the run over and changes nothing in it; stopped and
resumed from either checkpoint format, it continues with the uninterrupted losses.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
APPLY = ROOT / "scripts" / "apply_megatron_patch.sh"
LAUNCH = ROOT / "scripts" / "launch_single_node.sh"
EXAMPLE = ROOT / "examples" / "data" / "internvl_subset.npz"
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
TRAIN_ITERS, STOP = 5, 3  # the stopped runs save and exit after STOP

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(
        not MEGATRON_LM_DIR,
        reason="set MEGATRON_LM_DIR to a Megatron-LM git checkout (tag core_v0.19.x) to test the "
        "patch on it; tests/scripts/test_patch_apply.py covers the apply script without one",
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
    """40 real records of the shipped example data (and, beside them, the model: tiny with 5
    LLM layers, which divide by no pipeline size)."""
    import json

    from megatron_omnibal.data.lengths import load_lengths, read_stats_config, save_lengths
    from megatron_omnibal.models.presets import PRESETS

    real = load_lengths(EXAMPLE)
    pick = np.sort(np.random.default_rng(1).choice(len(real), 40, replace=False))
    path = tmp_path_factory.mktemp("lengths") / "lengths.npz"
    save_lengths(real.subset(pick), path, config=read_stats_config(EXAMPLE))  # 256 per tile
    spec = PRESETS["tiny"].to_dict()
    spec["llm"]["num_layers"] = 5
    (path.parent / "tiny5.json").write_text(json.dumps(spec))
    return path


def train_flags(lengths: Path, *extra: str) -> list[str]:
    """A tiny VLM with 5 LLM layers at PP=2 (ViT on stage 0, LLM split 1+4), TRAIN_ITERS
    steps."""
    return [
        "--omnibal", "--omnibal-model", str(lengths.parent / "tiny5.json"),
        "--omnibal-lengths", str(lengths),
        "--omnibal-vit-budget", "16", "--omnibal-token-budget", "160",
        "--omnibal-text-scale", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--pipeline-model-parallel-size", "2", "--omnibal-vit-pp-layers", "4,0",
        "--omnibal-llm-pp-layers", "1,4", "--lr", "1e-3", "--clip-grad", "0",
        "--transformer-impl", "local", "--seed", "7", "--log-interval", "1",
        "--train-iters", str(TRAIN_ITERS), *extra,
    ]  # fmt: skip


def launch(lengths: Path, out: Path, flags: list[str], *entry: str) -> dict[int, float]:
    """Train through the single-node launcher (CPU, 2 processes) in `out`; the logged loss per
    iteration."""
    # The venv first on PATH, as when it is activated: Megatron-LM's initialize builds the
    # checkout's dataset helpers with `make`, which calls python3 (and needs its pybind11).
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "TORCHRUN": f"{sys.executable} -m torch.distributed.run"}
    cmd = ["bash", str(LAUNCH), "--cpu", "--nproc-per-node", "2", *entry]
    out.mkdir(parents=True, exist_ok=True)
    proc = run([*cmd, *train_flags(lengths, *flags)], timeout=300, env=env, cwd=out)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    losses = {int(i): float(v) for i, v in
              re.findall(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)", log)}  # fmt: skip
    assert losses, log[-3000:]
    return losses


def dist_tensors(step: Path) -> dict[str, np.ndarray]:
    """Every tensor of a torch_dist checkpoint (model and optimizer), global, by key."""
    import warnings

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp_to_torch_save(step, step.parent / f"{step.name}.pt")
    state = torch.load(step.parent / f"{step.name}.pt", weights_only=False)
    return {k: v.float().numpy() for k, v in state.items() if isinstance(v, torch.Tensor)}


def resumed_losses(whole: dict[int, float], start: int) -> dict[int, float]:
    """The losses a run resumed after iteration `start` logs, from the uninterrupted run's:
    Megatron does not reset its loss average after a run's first iteration (is_first_iteration
    in training_log), so a run's second logged value is the mean of its first two."""
    first, second = whole[start + 1], whole[start + 2]
    return {start + 1: first, start + 2: (first + second) / 2}


@pytest.fixture(scope="module")
def package_run(lengths_file: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """The oracle: the package's own entry, TRAIN_ITERS steps uninterrupted, its default
    (torch_dist) checkpoint saved at STOP."""
    out = tmp_path_factory.mktemp("package")
    flags = ["--save", str(out / "ckpt"), "--save-interval", str(STOP)]
    return SimpleNamespace(losses=launch(lengths_file, out, flags), ckpt=out / "ckpt")


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_patched_pretrain_vlm_saves_and_resumes_like_the_package_entry(
    patched_checkout: Path, lengths_file: Path, package_run: SimpleNamespace, tmp_path: Path,
    ckpt_format: str,
) -> None:  # fmt: skip
    """The patched script trains like the package's entry, stops at STOP with a checkpoint
    (--exit-interval) and resumes from it: the same losses as the uninterrupted package run.
    torch_dist (Megatron's default) runs its writer's helper process, which re-imports the
    patched script; its checkpoint holds exactly the package run's tensors."""
    script = str(patched_checkout / "pretrain_vlm.py")
    ckpt = tmp_path / "ckpt"
    common = ["--ckpt-format", ckpt_format]
    stopped = launch(lengths_file, tmp_path / "stopped",
                     [*common, "--save", str(ckpt), "--save-interval", "100",
                      "--exit-interval", str(STOP)], "--script", script)  # fmt: skip
    whole = package_run.losses
    assert stopped == {i: whole[i] for i in range(1, STOP + 1)}
    assert all(np.isfinite(list(stopped.values())))
    step = ckpt / f"iter_{STOP:07d}"
    if ckpt_format == "torch_dist":
        mine, oracle = dist_tensors(step), dist_tensors(package_run.ckpt / step.name)
        assert mine.keys() == oracle.keys() and len(mine) > 20
        for key, value in mine.items():
            np.testing.assert_array_equal(value, oracle[key], err_msg=key)
    else:
        shards = sorted(p.parent.name for p in step.glob("*/model_optim_rng.pt"))
        assert shards == ["mp_rank_00_000", "mp_rank_00_001"]
    resumed = launch(lengths_file, tmp_path / "resumed", [*common, "--load", str(ckpt)],
                     "--script", script)  # fmt: skip
    assert resumed == pytest.approx(resumed_losses(whole, STOP), rel=1e-6)


def test_unpatched_checkout_with_omnibal_flags_names_the_missing_patch(
    lengths_file: Path, tmp_path: Path
) -> None:
    """The launcher refuses the checkout's own pretrain_vlm.py (not patched) with --omnibal*
    flags, naming the apply script, before torchrun starts."""
    clone = tmp_path / "Megatron-LM"
    cloned = run(["git", "clone", "-q", "--shared", str(MEGATRON_LM_DIR), str(clone)], 300)
    assert cloned.returncode == 0, cloned.stderr
    proc = run(["bash", str(LAUNCH), "--cpu", "--script", str(clone / "pretrain_vlm.py"),
                *train_flags(lengths_file)])  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"launch_single_node.sh: error: {clone}/pretrain_vlm.py is not patched for --omnibal "
        "(its Megatron-LM would fail on the --omnibal* flags): run "
        f"scripts/apply_megatron_patch.sh {clone}"
    )


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
        "from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron\n"
        "enable_cpu_megatron()  # Python 3.11: typing.override for megatron.training\n"
        f"sys.path.insert(0, {str(patched_checkout)!r})\n"
        "import pretrain_vlm\n"
        "print(pretrain_vlm.add_vlm_extra_args(argparse.ArgumentParser()).format_help())\n"
    )
    proc = run([sys.executable, "-c", show_help], cwd=patched_checkout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for flag in ("--freeze-LM", "--omnibal", "--omnibal-plan", "--omnibal-vit-pp-layers"):
        assert re.search(rf"^\s+{re.escape(flag)}\b", proc.stdout, re.MULTILINE), flag
