"""`omnibal preflight CONFIG.yaml`: the preflight of a fine-tuning config's plan, run now."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

HELP = "run a fine-tuning config's plan for a few steps and check memory and time per stage"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_omnibal.commands.finetune import add_config_arguments

    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """The steps before it (stats, plan, convert; each skipped when up to date), then the
    preflight, run even when up to date or turned off for `omnibal finetune`. Exit status 1 when
    a stage would run out of memory."""
    from megatron_omnibal.preflight.report import table
    from megatron_omnibal.workflow.config import load_config
    from megatron_omnibal.workflow.paths import OutputPaths
    from megatron_omnibal.workflow.runner import Selection, StepFailed, dry_run, run_steps

    config = load_config(args.config)
    if config.preflight is False:
        config = replace(config, preflight=True)
    if config.nodes > 1 and not {"NODE_RANK", "MASTER_ADDR"} <= set(os.environ):
        raise ValueError(
            f"{config.nodes} nodes: run `omnibal preflight` on every node with NODE_RANK and "
            "MASTER_ADDR set (or let the launch scripts of `omnibal finetune` run it)"
        )
    paths = OutputPaths(config.out)
    before = Selection(last="convert")
    itself = Selection(first="preflight", last="preflight", force_first=True)
    if args.dry_run:
        for selection in (before, itself):
            dry_run(config, paths, selection, sys.stdout)
        return 0
    paths.root.mkdir(parents=True, exist_ok=True)
    try:
        for selection in (before, itself):
            run_steps(config, paths, selection, sys.stdout)
    except StepFailed as exc:
        print(f"omnibal preflight: {exc}", file=sys.stderr)
        return 1
    print("\n".join(table(json.loads(paths.preflight.read_text()))))
    print(f"wrote {paths.preflight}")
    return 0
