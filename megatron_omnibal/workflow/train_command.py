"""The training command of a fine-tuning run: the one place that turns the config into
Megatron flags and a torchrun launch (through scripts/launch_*.sh).

`--omnibal-plan` sets everything the plan decided (sizes, the model's shape, layout,
recompute, batch, precision, budgets); the config adds the data, checkpoints and optimizer,
then its `megatron_args`, which Megatron reads last and so win.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from megatron_omnibal.megatron.flags.declarations import config_key, config_settings
from megatron_omnibal.workflow.config import FinetuneConfig
from megatron_omnibal.workflow.paths import OutputPaths

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def training_flags(config: FinetuneConfig, paths: OutputPaths, iters: int | str) -> list[str]:
    """Flags of pretrain_vlm for `iters` steps; `--load` and `--save` share one directory, so
    a second start resumes from the last checkpoint."""
    flags = [
        "--omnibal",
        "--omnibal-plan", str(paths.plan),
        "--omnibal-data", config.data,
        "--omnibal-lengths", str(paths.lengths),
        "--pretrained-checkpoint", str(paths.start_checkpoint),
        "--load", str(paths.train_checkpoint),
        "--save", str(paths.train_checkpoint),
        "--save-interval", str(config.save_interval),
        "--train-iters", str(iters),
        "--lr", str(config.lr),
        "--min-lr", str(config.min_lr),
        "--lr-decay-style", "cosine",
        "--seed", str(config.seed),
        "--log-interval", str(config.log_interval),
    ]  # fmt: skip
    if config.device == "cuda":
        # megatron-core 0.19 without Transformer Engine or Apex does not resume a torch_dist
        # checkpoint of the distributed optimizer on CPU (load_checkpoint stops at
        # DistributedOptimizer.state_dict's `assert len(steps) == 1`); a CPU trial run gains
        # nothing from sharding it
        flags.append("--use-distributed-optimizer")
    if config.warmup >= 1:
        flags += ["--lr-warmup-iters", str(int(config.warmup))]
    else:
        flags += ["--lr-warmup-fraction", str(config.warmup)]
    flags += config_flags(config)
    if config.trust_remote_code:
        flags.append("--trust-remote-code")
    if config.device == "cpu":
        flags += ["--transformer-impl", "local"]
    return flags + list(config.megatron_args)


def config_flags(config: FinetuneConfig) -> list[str]:
    """The --omnibal* flags of the config's keys that set them (flags/declarations.py: the
    config key of each setting; a key at its flag's default adds nothing)."""
    flags = []
    for s in config_settings():
        flags += s.argv(getattr(config, s.config_key))
    lora = config.lora_spec
    if lora is not None:  # adapter-only checkpoints: the base is --pretrained-checkpoint
        for s in config_settings("lora"):
            flags += s.argv(getattr(lora, config_key(s, "lora")))
    return flags


def launch_command(
    config: FinetuneConfig, flags: list[str], node_rank: int | None = None, module: str = ""
) -> list[str]:
    """torchrun through the project's launcher: this node alone (single node), or node
    `node_rank` of `config.nodes` (the rendezvous from MASTER_ADDR / MASTER_PORT); of the
    training's entry point, or of `module` run with the same flags (the preflight)."""
    if not SCRIPTS.is_dir():
        raise ValueError(f"no launch scripts at {SCRIPTS}: training runs the launchers of a "
                         "source checkout (pip install -e)")  # fmt: skip
    if config.nodes == 1:
        cmd = ["bash", str(SCRIPTS / "launch_single_node.sh")]
    else:
        cmd = [
            "bash",
            str(SCRIPTS / "launch_multi_node.sh"),
            "--nnodes",
            str(config.nodes),
            "--node-rank",
            str(node_rank),
        ]
    if config.device == "cpu":
        cmd.append("--cpu")
    if module:
        cmd += ["--module", module]
    return [*cmd, "--nproc-per-node", str(config.gpus_per_node), "--", *flags]


def launch_env(config: FinetuneConfig) -> dict[str, str]:
    """The launcher's environment: $TORCHRUN if set (as the launch scripts read it), else
    torchrun of this interpreter (a virtual environment need not be on PATH); the config's
    rendezvous unless the environment sets one."""
    env = {"TORCHRUN": os.environ.get("TORCHRUN") or f"{sys.executable} -m torch.distributed.run"}
    if config.nodes > 1:
        env["MASTER_ADDR"] = os.environ.get("MASTER_ADDR", config.master_addr or "")
        env["MASTER_PORT"] = os.environ.get("MASTER_PORT", str(config.master_port))
    return env
