"""Runs the steps in order: each skipped when up to date, else run with its output in
OUTPUT/logs/STEP.log; a failure names the step and its log."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass
from typing import TextIO

from megatron_omnibal.workflow.config import FinetuneConfig
from megatron_omnibal.workflow.freshness import same_command, staleness, write_state
from megatron_omnibal.workflow.paths import OutputPaths
from megatron_omnibal.workflow.steps import STEPS, Step, build_step

_ERROR = re.compile(r"^\w*(Error|Exception)\b.*: |\berror: ")


class StepFailed(RuntimeError):
    """A step's command failed or left unfinished outputs; the message names step and log."""


@dataclass(frozen=True, kw_only=True)
class Selection:
    """Which steps to consider: `first` .. `last` of STEPS; `first` runs even if up to date
    when `force_first` (the user named it with --from)."""

    first: str = STEPS[0]
    last: str = STEPS[-1]
    force_first: bool = False

    def names(self) -> list[str]:
        lo, hi = STEPS.index(self.first), STEPS.index(self.last)
        if lo > hi:
            raise ValueError(f"--from {self.first} comes after --until {self.last}")
        return list(STEPS[lo : hi + 1])


def show(step: Step) -> str:
    """The step's command as one shell line (its environment in front)."""
    env = [f"{k}={shlex.quote(v)}" for k, v in step.env.items()]
    return " ".join([*env, shlex.join(step.command)])


def dry_run(config: FinetuneConfig, paths: OutputPaths, selection: Selection, out: TextIO) -> None:
    """Print each command that would run (and which would be skipped), running nothing."""
    for name in selection.names():
        step = build_step(name, config, paths, node_rank=_node_rank(config))
        why = staleness(step, paths)
        forced = selection.force_first and name == selection.first
        status = "would run" if why or forced else "up to date, would skip"
        if name == "preflight" and not config.runs_preflight:
            status = "off in the config (preflight: false), would skip"
        print(f"[{name}] {status}; log {step.log}\n  {show(step)}", file=out)


def run_steps(
    config: FinetuneConfig, paths: OutputPaths, selection: Selection, out: TextIO
) -> str | None:
    """Run the selected steps; returns the last step this process completed (None: nothing
    done), which may be before `selection.last` (several nodes: see docs/finetune.md)."""
    node_rank = _node_rank(config)
    done = None
    for name in selection.names():
        if name == "preflight" and not config.runs_preflight:
            print(f"[{name}] off in the config (preflight: false), skipped", file=out)
            continue
        step = build_step(name, config, paths, node_rank=node_rank)
        why = staleness(step, paths)
        if name == "preflight" and why and config.nodes > 1 and node_rank is None:
            print(f"[{name}] several nodes: runs in the launch scripts, before training",
                  file=out)  # fmt: skip
            continue
        if name == "train" and why and config.nodes > 1 and node_rank is None:
            from megatron_omnibal.workflow.launch_scripts import write_launch_scripts

            if not same_command(paths, step):
                _move_aside(step, step.log)
            write_launch_scripts(config, paths, out)
            return done
        if node_rank is not None and name in STEPS[: STEPS.index("preflight")] and why:
            raise ValueError(
                f"step {name} is not done ({why}); with NODE_RANK set only the preflight and "
                "training run: run `omnibal finetune CONFIG --until convert` once on one machine "
                "first (OUTPUT on a file system every node sees)"
            )
        if why is None and not (selection.force_first and name == selection.first):
            print(f"[{name}] up to date, skipped", file=out)
        else:
            print(f"[{name}] running ({why or 'asked for'}); log {step.log}", file=out)
            out.flush()
            _run(step, paths)
        done = name
        if name == "train" and node_rank not in (None, 0):
            return done  # node 0 exports and compares
    return done


def _node_rank(config: FinetuneConfig) -> int | None:
    """This node's rank when NODE_RANK and MASTER_ADDR say this is one node of several."""
    if config.nodes == 1 or "NODE_RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    rank = os.environ["NODE_RANK"]
    if not rank.isdigit() or int(rank) >= config.nodes:
        raise ValueError(f"NODE_RANK={rank} is not a node rank of {config.nodes} nodes")
    return int(rank)


def _run(step: Step, paths: OutputPaths) -> None:
    log = step.log
    log.parent.mkdir(parents=True, exist_ok=True)
    if step.starts_over and not same_command(paths, step):
        _move_aside(step, log)
    write_state(paths, step, finished=False)
    with open(log, "a") as fh:
        fh.write(
            f"=== omnibal finetune: {step.name} started {time.strftime('%F %T')}: {show(step)}\n"
        )
        fh.flush()
        stdout = open(step.stdout, "w") if step.stdout else fh  # noqa: SIM115 - closed below
        try:
            proc = subprocess.run(
                step.command, stdout=stdout, stderr=fh, env={**os.environ, **step.env}
            )
        finally:
            if stdout is not fh:
                stdout.close()
    if proc.returncode not in step.ok_codes:
        said = step.verdict() if step.verdict else None
        if said:
            raise StepFailed(f"step {step.name}: {said}; its log: {log}")
        raise StepFailed(
            f"step {step.name} failed (exit status {proc.returncode}); its log: {log}\n{_tail(log)}"
        )
    unfinished = step.incomplete() if step.incomplete else None
    if unfinished:
        again = " (run again to go on from its last checkpoint)" if step.resumable else ""
        raise StepFailed(f"step {step.name}: {unfinished}; its log: {log}{again}")
    write_state(paths, step, finished=True)


def _move_aside(step: Step, log) -> None:
    """Another command than the one that wrote these outputs: start over, keeping the old
    outputs (and log) once as NAME.previous."""
    for path in (*step.starts_over, log):
        if path.exists():
            previous = path.with_name(path.name + ".previous")
            if previous.is_dir():
                import shutil

                shutil.rmtree(previous)
            path.replace(previous)


def _tail(log, lines: int = 15) -> str:
    """The log's error lines (a traceback's last line, `error:` messages; each once), else
    its last lines: torchrun ends a failed run with a summary that names no cause."""
    text = log.read_text(errors="replace").splitlines()
    errors = [line for line in text if _ERROR.search(line) and "elastic" not in line]
    shown = list(dict.fromkeys(errors))[-5:] or text[-lines:]
    return "\n".join(f"  | {line}" for line in shown)
