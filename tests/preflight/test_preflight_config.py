"""The preflight from an `omnibal finetune` config: `omnibal preflight CONFIG.yaml`, and the
workflow's preflight step before training (skipped when up to date, off with `preflight: false`,
stopping the workflow with its verdict when a stage would not fit).

The config's `preflight` key is checked when the file is read; then real runs through the CLI,
as a user starts them: a tiny transformers InternVL and a generated dataset, PP=2 on 2 gloo
processes, the plan of the workflow's own `omnibal plan`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_omnibal.data.formats.generate import qa_dataset
from megatron_omnibal.workflow.config import config_from_dict, preflight_flags
from tests.helpers.finetune_runs import finetune, omnibal, step_status, write_config  # noqa: E402


def _omnibal_preflight(config: Path, *flags: str):
    return omnibal("preflight", config, *flags)


def test_the_preflight_key_is_checked_when_the_config_is_read(tmp_path) -> None:
    base = {"model": "m", "data": "d", "output": "o"}
    assert preflight_flags(True) == [] and preflight_flags({}) == []
    assert preflight_flags({"device_memory_gib": 70, "typical_steps": 2}) == [
        "--device-memory-gib", "70", "--typical-steps", "2"]  # fmt: skip
    assert config_from_dict({**base, "preflight": False}, tmp_path).runs_preflight is False
    assert config_from_dict({**base, "preflight": None}, tmp_path).runs_preflight  # the default
    for value, message in (
        ({"device_memory": 70}, "preflight: unknown option 'device_memory' (known: "),
        ({"typical_steps": 0}, "preflight.typical_steps: must be a positive integer, got 0"),
        ({"memory_margin_gib": -1}, "preflight.memory_margin_gib: must be >= 0"),
        ({"worst_steps": True}, "preflight.worst_steps: expected a number, got True"),
        ("yes", "preflight: expected true, false or a mapping of preflight options, got 'yes'"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            config_from_dict({**base, "preflight": value}, tmp_path)


def test_dry_runs_show_the_preflight_command_and_a_config_that_turns_it_off(tmp_path) -> None:
    qa_dataset(tmp_path / "data", samples=40, images=11)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    config = write_config(tmp_path, "run.yaml", preflight={"device_memory_gib": 70})
    proc = _omnibal_preflight(config, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = dict(re.findall(r"^\[([a-z-]+)\] would run; log .*\n  (.*)$", proc.stdout, re.M))
    assert list(lines) == ["stats", "plan", "convert", "preflight"]
    command = lines["preflight"]
    assert "launch_single_node.sh --cpu --module megatron_omnibal.preflight" in command
    assert f"--pretrained-checkpoint {tmp_path / 'out/checkpoints/start'}" in command
    assert command.endswith(f"--device-memory-gib 70 --out {tmp_path / 'out/preflight.json'}")
    for flag in ("--load", "--save", "--save-interval", "--train-iters"):
        assert f" {flag} " not in command  # it starts from the converted checkpoint, saves nothing
    off = finetune(write_config(tmp_path, "off.yaml", preflight=False), "--dry-run")
    assert "[preflight] off in the config (preflight: false), would skip" in off.stdout
    assert "[train] would run" in off.stdout
    # `omnibal preflight` runs it all the same: it was asked for
    proc = _omnibal_preflight(tmp_path / "off.yaml", "--dry-run")
    assert "[preflight] would run" in proc.stdout


@pytest.mark.megatron
@pytest.mark.slow
def test_omnibal_preflight_of_a_config_passes_and_a_tight_limit_stops_the_workflow(tmp_path):
    made = qa_dataset(tmp_path / "data", samples=160, images=41, seed=2)
    from megatron_omnibal.models.tiny_hf import write_tiny_internvl

    write_tiny_internvl(tmp_path / "hf", made.tokenizer)
    options = {"typical_steps": 2, "memory_margin_gib": 0}
    config = write_config(tmp_path, "run.yaml", preflight=options)
    out = tmp_path / "out"
    proc = _omnibal_preflight(config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert step_status(proc.stdout) == dict.fromkeys(("stats", "plan", "convert", "preflight"),
                                                     "ran")  # fmt: skip
    report = json.loads((out / "preflight.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert report["ok"] and report["step_ms"]["planned"] == plan["predicted"]["step_ms"]
    assert len(report["stages"]) == plan["parallel"]["pp"] == 2
    for st, want in zip(report["stages"], plan["stages"], strict=True):
        assert st["planned"]["peak_memory_gib"] == want["peak_memory_gib"]
        assert st["verdict"]["memory"] == "fits" and st["measured"]["forward_ms"] > 0
    assert "preflight: OK" in proc.stdout and f"wrote {out / 'preflight.json'}" in proc.stdout
    log = (out / "logs" / "preflight.log").read_text()
    assert f"loading release checkpoint from {out / 'checkpoints/start'}" in log
    # the workflow finds it up to date: `omnibal finetune` would go on with training
    dry = finetune(config, "--dry-run")
    assert re.search(r"^\[preflight\] up to date, would skip", dry.stdout, re.M)
    assert "[train] would run" in dry.stdout

    peaks = [st["measured"]["peak_memory_gib"] for st in report["stages"]]
    heavy = max(range(2), key=peaks.__getitem__)
    assert max(peaks) > 1.1 * min(peaks)
    tight = write_config(tmp_path, "tight.yaml",
                         preflight={**options, "device_memory_gib": sum(peaks) / 2})  # fmt: skip
    proc = finetune(tight)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert step_status(proc.stdout) == {"stats": "skipped", "plan": "skipped",
                                        "convert": "skipped", "preflight": "ran"}  # fmt: skip
    assert f"step preflight: the preflight failed: stage {heavy} would run out of memory" in (
        proc.stderr)
    assert f"its report: {out / 'preflight.json'}" in proc.stderr
    assert "recompute that would fit: --omnibal-vit-recompute" in proc.stderr
    assert not (out / "logs" / "train.log").exists()  # training never started
    report = json.loads((out / "preflight.json").read_text())
    assert [st["verdict"]["ok"] for st in report["stages"]] == [s != heavy for s in range(2)]
    # failed: run again, not skipped
    assert "[preflight] would run" in finetune(tight, "--dry-run").stdout
