"""`omnibal finetune CONFIG.yaml`: the whole workflow from one config file."""

from __future__ import annotations

import argparse
import sys

HELP = "run stats, plan, convert, preflight, train, export and compare-hf from one YAML config"


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The config file and --dry-run, as every command of the workflow takes them."""
    parser.add_argument("config", help="the run's YAML file (keys: docs/finetune.md)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print every command it would run (and which it would skip), run nothing",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from megatron_omnibal.workflow.steps import STEPS

    add_config_arguments(parser)
    parser.add_argument(
        "--from",
        dest="first",
        choices=STEPS,
        help="start at this step (run even if up to date); the steps before are left as they are",
    )
    parser.add_argument("--until", dest="last", choices=STEPS, help="stop after this step")


def run(args: argparse.Namespace) -> int:
    from megatron_omnibal.workflow.config import load_config
    from megatron_omnibal.workflow.paths import OutputPaths
    from megatron_omnibal.workflow.report import render, write_report
    from megatron_omnibal.workflow.runner import Selection, StepFailed, dry_run, run_steps
    from megatron_omnibal.workflow.steps import STEPS

    config = load_config(args.config)
    paths = OutputPaths(config.out)
    selection = Selection(
        first=args.first or STEPS[0],
        last=args.last or STEPS[-1],
        force_first=args.first is not None,
    )
    selection.names()  # --from after --until: a usage error before any work
    if args.dry_run:
        dry_run(config, paths, selection, sys.stdout)
        return 0
    paths.root.mkdir(parents=True, exist_ok=True)
    try:
        done = run_steps(config, paths, selection, sys.stdout)
    except StepFailed as exc:
        print(f"omnibal finetune: {exc}", file=sys.stderr)
        return 1
    if done is None or STEPS.index(done) < STEPS.index("train"):
        return 0
    report = write_report(config, paths)
    print("\n" + render(report), end="")
    print(f"wrote {paths.report_md}\nwrote {paths.report_json}")
    verdict = report["compare_hf"]
    return 1 if verdict is not None and not verdict["ok"] else 0
