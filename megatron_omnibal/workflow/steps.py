"""The seven steps of a fine-tuning run, each one of the project's own commands.

A step is built just before it runs (the training command needs the plan the step before
wrote). Its inputs and outputs decide, with its command, whether it is up to date
(freshness.py).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from megatron_omnibal.workflow.config import FinetuneConfig, preflight_flags
from megatron_omnibal.workflow.paths import TRACKER, OutputPaths, checkpoint_iteration
from megatron_omnibal.workflow.train_command import launch_command, launch_env, training_flags

STEPS = ("stats", "plan", "convert", "preflight", "train", "export", "compare-hf")
OMNIBAL = [sys.executable, "-m", "megatron_omnibal.cli"]


@dataclass(frozen=True, kw_only=True)
class Step:
    name: str
    command: list[str]
    log: Path
    key: tuple[str, ...] = ()  # what decides its outputs (default: the command)
    inputs: tuple[Path, ...]
    outputs: tuple[Path, ...]
    env: dict[str, str] = field(default_factory=dict)
    stdout: Path | None = None  # where the command's stdout goes (default: the log)
    ok_codes: tuple[int, ...] = (0,)
    resumable: bool = False  # a second start of the same command continues the first
    starts_over: tuple[Path, ...] = ()  # moved aside when the command changed
    incomplete: Callable[[], str | None] | None = None  # why its outputs are unfinished
    verdict: Callable[[], str | None] | None = None  # what its outputs say when it failed


def build_step(
    name: str, config: FinetuneConfig, paths: OutputPaths, node_rank: int | None = None
) -> Step:
    """Step `name`; its command as it would run now (placeholders where an earlier step's
    output is still missing, for --dry-run)."""
    return _BUILDERS[name](config, paths, node_rank)


def _stats(config: FinetuneConfig, paths: OutputPaths, _node: int | None) -> Step:
    cmd = [*OMNIBAL, "stats", config.data, "--model", config.model, "--out", str(paths.lengths),
           "--png", str(paths.stats_png), "--no-progress"]  # fmt: skip
    for flag, value in (
        ("--image-root", config.image_root),
        ("--tokenizer", config.tokenizer),
        ("--system-prompt", config.system_prompt),
        ("--template", config.template),
    ):
        if value is not None:
            cmd += [flag, value]
    if config.trust_remote_code:
        cmd.append("--trust-remote-code")
    inputs = (*_data_files(config), *_model_files(config))
    if config.tokenizer:
        inputs += (Path(config.tokenizer),)
    return Step(
        name="stats",
        command=cmd,
        log=paths.log("stats"),
        inputs=inputs,
        outputs=(paths.lengths, paths.stats_png),
    )


def _plan(config: FinetuneConfig, paths: OutputPaths, _node: int | None) -> Step:
    cmd = [*OMNIBAL, "plan", "--model", config.model, "--hardware", config.hardware, "--gpus",
           str(config.gpus), "--lengths", str(paths.lengths), "--global-batch",
           str(config.global_batch), "--seed", str(config.seed), "--out",
           str(paths.plan)]  # fmt: skip
    for flag, value in (("--tp", config.tp), ("--pp", config.pp), ("--ep", config.ep)):
        if value is not None:
            cmd += [flag, str(value)]
    lora = config.lora_spec
    if lora is not None:  # planned with LoRA's memory and time
        cmd += ["--lora-rank", str(lora.rank), "--lora-targets", ",".join(lora.targets)]
        if lora.train:
            cmd += ["--lora-train", ",".join(lora.train)]
    inputs = (paths.lengths, paths.state("stats"), *_model_files(config))
    if Path(config.hardware).is_file():
        inputs += (Path(config.hardware),)
    return Step(
        name="plan", command=cmd, log=paths.log("plan"), inputs=inputs, outputs=(paths.plan,)
    )


def _convert(config: FinetuneConfig, paths: OutputPaths, _node: int | None) -> Step:
    cmd = [*OMNIBAL, "convert", "hf-to-megatron", config.model, "--plan", str(paths.plan), "--out",
           str(paths.start_checkpoint), "--force", "--no-progress"]  # fmt: skip
    return Step(
        name="convert",
        command=cmd,
        log=paths.log("convert"),
        inputs=(paths.plan, paths.state("plan"), *_model_files(config)),
        outputs=(paths.start_checkpoint / TRACKER,),
    )


def _preflight(config: FinetuneConfig, paths: OutputPaths, node_rank: int | None) -> Step:
    """The training's own flags (its stages, recompute, schedule and start checkpoint), run
    by the preflight module: it saves nothing, and starts from the converted checkpoint even
    when a training checkpoint exists."""
    from megatron_omnibal.preflight.options import without_long_run_flags

    flags = [*without_long_run_flags(training_flags(config, paths, 1), ("--load", "--save",
             "--save-interval", "--train-iters")), *preflight_flags(config.preflight),
             "--out", str(paths.preflight)]  # fmt: skip

    def verdict() -> str | None:
        started = paths.state("preflight")  # recorded as started just before it ran
        try:
            if paths.preflight.stat().st_mtime_ns < started.stat().st_mtime_ns:
                return None  # an earlier run's report
            report = json.loads(paths.preflight.read_text())
        except (OSError, ValueError):
            return None
        failures = "; ".join(report.get("failures", [])) or "see the report"
        return f"the preflight failed: {failures}; its report: {paths.preflight}"

    return Step(
        name="preflight",
        command=launch_command(config, flags, node_rank, module="megatron_omnibal.preflight"),
        log=paths.log("preflight" if node_rank is None else f"preflight.node{node_rank}"),
        key=(*flags, _plan_digest(paths), config.device, str(config.nodes),
             str(config.gpus_per_node)),  # fmt: skip
        inputs=_launch_inputs(config, paths),
        outputs=(paths.preflight,),
        env=launch_env(config),
        verdict=verdict,
    )


def _train(config: FinetuneConfig, paths: OutputPaths, node_rank: int | None) -> Step:
    iters = planned_iterations(config, paths)
    flags = training_flags(config, paths, iters)

    def incomplete() -> str | None:
        done = checkpoint_iteration(paths.train_checkpoint)
        if done is None or done < int(iters):
            return f"training stopped at iteration {done or 0} of {iters}"
        return None

    return Step(
        name="train",
        command=launch_command(config, flags, node_rank),
        log=paths.log("train" if node_rank is None else f"train.node{node_rank}"),
        key=(*flags, _plan_digest(paths), config.device, str(config.nodes),
             str(config.gpus_per_node)),  # fmt: skip
        inputs=_launch_inputs(config, paths),
        outputs=(paths.train_checkpoint / TRACKER,),
        env=launch_env(config),
        resumable=True,
        starts_over=(paths.train_checkpoint,),
        incomplete=incomplete,
    )


def planned_iterations(config: FinetuneConfig, paths: OutputPaths) -> int | str:
    """`iters`, or the steps of `epochs` epochs (a placeholder before the plan exists)."""
    if config.iters is not None:
        return config.iters
    epochs = config.epochs or 1
    if not (paths.plan.is_file() and paths.lengths.is_file()):
        return f"<the steps of {epochs} epoch(s)>"
    from megatron_omnibal.workflow.epochs import epoch_iterations

    return epoch_iterations(paths.plan, paths.lengths, epochs, config.seed)


def _export(config: FinetuneConfig, paths: OutputPaths, _node: int | None) -> Step:
    cmd = [*OMNIBAL, "convert", "megatron-to-hf", str(paths.train_checkpoint), "--like",
           config.model, "--out", str(paths.export), "--force", "--no-progress"]  # fmt: skip
    outputs: tuple[Path, ...] = (paths.export / "config.json",)
    if _peft_adapter(config):  # the merged model, and the PEFT adapter beside it
        cmd += ["--adapter-out", str(paths.adapter)]
        outputs += (paths.adapter / "adapter_config.json",)
    return Step(
        name="export",
        command=cmd,
        log=paths.log("export"),
        inputs=(paths.train_checkpoint / TRACKER, paths.state("train"), *_model_files(config)),
        outputs=outputs,
    )


def _compare(config: FinetuneConfig, paths: OutputPaths, _node: int | None) -> Step:
    cmd = [*OMNIBAL, "compare-hf", str(paths.export), str(paths.train_checkpoint)]
    if _peft_adapter(config):  # the merged export, and the base with the adapter (peft)
        cmd += ["--adapter", str(paths.adapter), "--base", config.model]

    def incomplete() -> str | None:
        try:
            json.loads(paths.compare.read_text())["ok"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"compare-hf wrote no verdict into {paths.compare}"
        return None

    return Step(
        name="compare-hf",
        command=cmd,
        log=paths.log("compare-hf"),
        inputs=(paths.state("export"), paths.train_checkpoint / TRACKER),
        outputs=(paths.compare,),
        stdout=paths.compare,
        ok_codes=(0, 1),  # 1 with a verdict: above the tolerance, which the report shows
        incomplete=incomplete,
    )


def _peft_adapter(config: FinetuneConfig) -> bool:
    """Whether the run's export includes a PEFT adapter (LoRA that PEFT can hold)."""
    from megatron_omnibal.models.lora import peft_refusal

    lora = config.lora_spec
    return lora is not None and peft_refusal(lora) is None


def _plan_digest(paths: OutputPaths) -> str:
    """The plan is named by path: its content decides whether a launch's outputs are this
    plan's."""
    return hashlib.sha256(paths.plan.read_bytes()).hexdigest() if paths.plan.is_file() else ""


def _launch_inputs(config: FinetuneConfig, paths: OutputPaths) -> tuple[Path, ...]:
    """What a torchrun launch of the plan's stages reads (the preflight's and training's)."""
    return (
        paths.plan,
        paths.lengths,
        paths.start_checkpoint / TRACKER,
        *(paths.state(s) for s in ("stats", "plan", "convert")),
        *_data_files(config),
    )


def _data_files(config: FinetuneConfig) -> tuple[Path, ...]:
    """The dataset file and the annotation files a meta file names."""
    from megatron_omnibal.data.inputs import read_inputs

    try:
        specs, _ = read_inputs(config.data, config.image_root)
    except ValueError:  # `omnibal stats` reports what is wrong, in the step's log
        specs = []
    return tuple(dict.fromkeys([Path(config.data), *(s.annotation for s in specs)]))


def _model_files(config: FinetuneConfig) -> tuple[Path, ...]:
    return tuple(sorted(p for p in Path(config.model).iterdir() if p.is_file()))


_BUILDERS: dict[str, Callable[[FinetuneConfig, OutputPaths, int | None], Step]] = {
    "stats": _stats,
    "plan": _plan,
    "convert": _convert,
    "preflight": _preflight,
    "train": _train,
    "export": _export,
    "compare-hf": _compare,
}
