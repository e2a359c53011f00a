"""When a step may be skipped: its recorded command is the one it would run now, it finished,
and its outputs are newer than its inputs (an earlier step's record among them: a step that
ran again makes the steps after it run again).

The command holds every setting the step depends on (the learning rate is in the training
command only, so changing it reruns training and what follows, never the statistics). Each
step's record, OUTPUT/state/STEP.json, is written before the step starts (unfinished) and again
when it finished.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megatron_omnibal.workflow.paths import OutputPaths
from megatron_omnibal.workflow.steps import Step


def fingerprint(step: Step) -> str:
    return hashlib.sha256(json.dumps(step.key or step.command).encode()).hexdigest()[:16]


def read_state(paths: OutputPaths, name: str) -> dict | None:
    try:
        return json.loads(paths.state(name).read_text())
    except (OSError, ValueError):
        return None


def write_state(paths: OutputPaths, step: Step, *, finished: bool) -> None:
    path = paths.state(step.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"fingerprint": fingerprint(step), "finished": finished, "command": step.command}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def same_command(paths: OutputPaths, step: Step) -> bool:
    """Whether the recorded command (finished or not) is the one `step` would run."""
    state = read_state(paths, step.name)
    return state is not None and state["fingerprint"] == fingerprint(step)


def staleness(step: Step, paths: OutputPaths) -> str | None:
    """Why `step` must run (None: it is up to date)."""
    state = read_state(paths, step.name)
    if state is None:
        return "not run yet"
    if state.get("fingerprint") != fingerprint(step):
        return "its settings changed"
    missing = [p for p in step.outputs if not p.exists()]
    if missing:
        return f"{missing[0]} is missing"
    if step.incomplete is not None:  # finished or not, as its outputs say
        unfinished = step.incomplete()
        if unfinished:
            return unfinished
    elif not state.get("finished"):
        return "it did not finish"
    # when the outputs were finished: the record's time (an output may keep its source's
    # time, as a copied config.json does), else the oldest output (a checkpoint completed by
    # launch scripts)
    done = (
        _mtime(paths.state(step.name))
        if state.get("finished")
        else min(_mtime(p) for p in step.outputs)
    )
    newer = [p for p in step.inputs if p.exists() and _mtime(p) > done]
    if newer:
        return f"{newer[0]} is newer than its output"
    return None


def _mtime(path: Path) -> int:
    return path.stat().st_mtime_ns
