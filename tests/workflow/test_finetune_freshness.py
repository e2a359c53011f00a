"""When `omnibal finetune` skips a step: the rule itself, on files written here (the full
workflow on Megatron is tests/workflow/test_finetune.py)."""

import os
import sys

from megatron_omnibal.workflow.freshness import staleness, write_state
from megatron_omnibal.workflow.paths import OutputPaths
from megatron_omnibal.workflow.steps import Step


def _step(tmp_path, command=("copy",), incomplete=None):
    return Step(name="plan", command=[sys.executable, *command], log=tmp_path / "plan.log",
                inputs=(tmp_path / "in.txt",), outputs=(tmp_path / "out.txt",),
                incomplete=incomplete)  # fmt: skip


def _age(path, seconds):
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns - int(seconds * 1e9)))


def test_a_step_is_up_to_date_only_after_it_finished_with_the_same_command(tmp_path):
    paths = OutputPaths(tmp_path)
    step = _step(tmp_path)
    (tmp_path / "in.txt").write_text("a")
    assert staleness(step, paths) == "not run yet"
    (tmp_path / "out.txt").write_text("b")
    write_state(paths, step, finished=False)
    assert staleness(step, paths) == "it did not finish"
    write_state(paths, step, finished=True)
    assert staleness(step, paths) is None
    assert staleness(_step(tmp_path, ("copy", "--lr", "2")), paths) == "its settings changed"
    (tmp_path / "out.txt").unlink()
    assert staleness(step, paths) == f"{tmp_path / 'out.txt'} is missing"


def test_an_input_newer_than_the_finish_makes_the_step_run_again(tmp_path):
    paths = OutputPaths(tmp_path)
    step = _step(tmp_path)
    for name in ("in.txt", "out.txt"):
        (tmp_path / name).write_text("x")
    write_state(paths, step, finished=True)
    _age(tmp_path / "in.txt", 10)
    _age(tmp_path / "out.txt", 20)  # older than its input, as a copied file keeps its time
    assert staleness(step, paths) is None  # the record's time counts: it is newer
    _age(paths.state("plan"), 30)
    assert staleness(step, paths) == f"{tmp_path / 'in.txt'} is newer than its output"


def test_a_step_whose_outputs_say_whether_it_finished(tmp_path):
    """Training: the checkpoint's iteration decides, also when launch scripts ran it."""
    paths = OutputPaths(tmp_path)
    reached = {"iteration": 4}

    def incomplete():
        done = reached["iteration"]
        return None if done >= 8 else f"training stopped at iteration {done} of 8"

    step = _step(tmp_path, incomplete=incomplete)
    (tmp_path / "in.txt").write_text("x")
    _age(tmp_path / "in.txt", 10)
    (tmp_path / "out.txt").write_text("x")
    write_state(paths, step, finished=False)
    assert staleness(step, paths) == "training stopped at iteration 4 of 8"
    reached["iteration"] = 8
    assert staleness(step, paths) is None
