"""Several nodes: one launch script per node, each running scripts/launch_multi_node.sh
(torchrun with a static rendezvous at node 0) with the run's training flags, after the
preflight of the same flags unless the config turns it off."""

from __future__ import annotations

import shlex
from typing import TextIO

from megatron_omnibal.workflow.config import FinetuneConfig
from megatron_omnibal.workflow.freshness import write_state
from megatron_omnibal.workflow.paths import OutputPaths
from megatron_omnibal.workflow.steps import build_step


def write_launch_scripts(config: FinetuneConfig, paths: OutputPaths, out: TextIO) -> None:
    """OUTPUT/launch/node_R.sh for every node R; the training step is recorded as started,
    so that a later `omnibal finetune` sees the finished checkpoint and goes on with export."""
    paths.launch.mkdir(parents=True, exist_ok=True)
    addr = (
        f"${{MASTER_ADDR:-{config.master_addr}}}"
        if config.master_addr
        else "${MASTER_ADDR:?set MASTER_ADDR to node 0's address}"
    )
    scripts = []
    for rank in range(config.nodes):
        step = build_step("train", config, paths, node_rank=rank)
        check = build_step("preflight", config, paths, node_rank=rank)
        preflight = [
            f"{shlex.join(check.command)} >>{shlex.quote(str(check.log))} 2>&1 || {{ echo "
            f"{shlex.quote(f'preflight failed: see {paths.preflight} and {check.log}')} >&2; "
            "exit 1; }",
        ] if config.runs_preflight else []  # fmt: skip
        env = {k: v for k, v in step.env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
        lines = [
            "#!/usr/bin/env bash",
            f"# Node {rank} of {config.nodes}: training of {paths.root} (written by `omnibal "
            "finetune`). Start it on every node at about the same time.",
            "set -euo pipefail",
            f'export MASTER_ADDR="{addr}"',
            f'export MASTER_PORT="${{MASTER_PORT:-{config.master_port}}}"',
            *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
            *preflight,
            f"exec {shlex.join(step.command)} >>{shlex.quote(str(step.log))} 2>&1",
        ]
        script = paths.launch / f"node_{rank}.sh"
        script.write_text("\n".join(lines) + "\n")
        script.chmod(0o755)
        scripts.append(script)
    write_state(paths, step, finished=False)
    print(
        f"[train] {config.nodes} nodes: run on node R (R = 0..{config.nodes - 1}) "
        f"{paths.launch}/node_R.sh, then `omnibal finetune` with this config again (it "
        "goes on with export and compare-hf); or run `omnibal finetune` on every node with "
        "NODE_RANK and MASTER_ADDR set",
        file=out,
    )
    for script in scripts:
        print(f"wrote {script}", file=out)
