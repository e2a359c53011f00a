"""Running `omnibal finetune` from the tests: a config beside a generated dataset and a
tiny HF checkpoint, the command as a user runs it, and which steps a run ran or skipped."""

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from megatron_omnibal.data.generate import SYSTEM_PROMPT

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("stats", "plan", "convert", "preflight", "train", "export", "compare-hf")
ITERS = 8


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


def finetune(config: Path, *flags: str, timeout: int = 400, **env: str):
    """`omnibal finetune CONFIG FLAGS` in a process of its own (extra environment: `env`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "megatron_omnibal.cli", "finetune", str(config), *flags],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
    )  # fmt: skip


def step_status(stdout: str) -> dict[str, str]:
    """Per step: 'ran' or 'skipped', from the run's own lines."""
    found = re.findall(r"^\[([a-z-]+)\] (running|up to date)", stdout, re.M)
    return {name: "ran" if what == "running" else "skipped" for name, what in found}
