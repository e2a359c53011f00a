"""Running `omnibal finetune` from the tests: a config beside a generated dataset and a
tiny HF checkpoint, the command as a user runs it, and which steps a run ran or skipped.

Its launches (preflight, training) start their ranks with local_ranks as $TORCHRUN: forked from
one interpreter that imported torch and megatron-core once, with torchrun's environment (the
launchers' real torchrun is tested in tests/scripts/test_scripts_launch.py and by the several
nodes test of tests/workflow/test_finetune.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from megatron_omnibal.data.formats.generate import SYSTEM_PROMPT

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("stats", "plan", "convert", "preflight", "train", "export", "compare-hf")
ITERS = 8
LOCAL_RANKS = f"{sys.executable} -m megatron_omnibal.megatron.runtime.local_ranks"
TORCHRUN = f"{sys.executable} -m torch.distributed.run"


def write_config(folder: Path, name: str, **changes) -> Path:
    """A config of `folder` (hf/, data/meta.json, output out/): PP=2 on 2 CPU processes."""
    doc = {
        "model": "hf", "data": "data/meta.json", "output": "out",
        "system_prompt": SYSTEM_PROMPT, "hardware": "A100-80G", "gpus_per_node": 2,
        "device": "cpu", "pp": 2, "iters": ITERS, "lr": 1e-3, "min_lr": 1e-4, "warmup": 1,
        "global_batch": 8, "save_interval": 2, "log_interval": 1, "seed": 1,
        "megatron_args": ["--num-workers", "1"],
    }  # fmt: skip
    path = folder / name
    path.write_text(yaml.safe_dump({**doc, **changes}))
    return path


def run_env(**env: str) -> dict[str, str]:
    """The environment of an `omnibal` command here: one thread, no TorchDynamo, local_ranks
    as torchrun (unless `env` names another)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
            "TORCHRUN": LOCAL_RANKS, **env}  # fmt: skip


def omnibal(command: str, config: Path, *flags: str, timeout: int = 400, **env: str):
    """`omnibal COMMAND CONFIG FLAGS` in a process of its own (extra environment: `env`)."""
    return subprocess.run(
        [sys.executable, "-m", "megatron_omnibal.cli", command, str(config), *flags],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=run_env(**env),
    )  # fmt: skip


def finetune(config: Path, *flags: str, timeout: int = 400, **env: str):
    """`omnibal finetune CONFIG FLAGS` in a process of its own (extra environment: `env`)."""
    return omnibal("finetune", config, *flags, timeout=timeout, **env)


def step_status(stdout: str) -> dict[str, str]:
    """Per step: 'ran' or 'skipped', from the run's own lines."""
    found = re.findall(r"^\[([a-z-]+)\] (running|up to date)", stdout, re.M)
    return {name: "ran" if what == "running" else "skipped" for name, what in found}
