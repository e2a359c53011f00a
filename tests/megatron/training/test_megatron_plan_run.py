"""The plan configures the run (torchrun, gloo, megatron.training): `--omnibal --omnibal-plan P`
with no Megatron model, parallel, batch or precision flag trains exactly as the command with the
flags the plan printed; the model, the pipeline split (5 LLM layers on 2 stages), the batch,
bf16 and the length file come from the plan. A run-wide note (Transformer Engine / Apex
missing) is printed once per run, not per module and rank. A global batch other than the
plan's is noted once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_omnibal.data.lengths import load_lengths
from megatron_omnibal.models.presets import PRESETS
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.make import make_plan
from megatron_omnibal.planner.plan_file.flags import plan_flags
from megatron_omnibal.planner.plan_file.plan import Plan, save_plan
from megatron_omnibal.planner.search.request import PlanRequest

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_ranks  # noqa: E402
from run_records import head_micro, records  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "megatron_workers" / "train_record.py"
VALIDATE = ROOT / "tests" / "helpers" / "megatron_workers" / "train_validate.py"
# What a user gives besides the plan: optimizer settings and the length of the run (and, for
# the tiny model on real lengths, the synthetic data's text scale).
OWN = ["--use-distributed-optimizer", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style",
       "cosine", "--train-iters", "3", "--seed", "7", "--log-interval", "1",
       "--omnibal-text-scale", "8"]  # fmt: skip


def _plan(tmp: Path, lengths_file: Path) -> Plan:
    """`omnibal plan` for tiny with 5 LLM layers at PP=2 on 2 GPUs (budgets set for the text
    scale of the run)."""
    spec = ModelSpec.from_dict({**PRESETS["tiny"].to_dict(), "name": "tiny5"})
    spec = replace(spec, llm=replace(spec.llm, num_layers=5))
    path = tmp / "plan.json"
    plan = make_plan(PlanRequest(model=spec, hardware=get_hardware("A100-80G"),
                                 lengths=load_lengths(lengths_file),
                                 lengths_path=str(lengths_file), gpus=2, tp=1, pp=2,
                                 micro_batches=2, global_batch=8, plan_path=str(path)))  # fmt: skip
    par = plan.parallel
    plan = replace(plan, data=replace(plan.data, vit_budget=16, token_budget=160,
                                      pack_cost=None),
                   megatron_flags=tuple(plan_flags(spec, par.tp, par.pp, par.dp,
                                                   par.micro_batches, 160, str(path))))  # fmt: skip
    save_plan(plan, path)
    return plan


def _run(out: Path, flags: list[str], fresh: bool = False) -> SimpleNamespace:
    code, stdout, stderr = run_ranks(WORKER, 2, [str(out), *flags], 300, fresh=fresh)
    assert code == 0, stdout[-3000:] + stderr[-6000:]
    return SimpleNamespace(stdout=stdout, stderr=stderr, records=records(out))


@pytest.fixture(scope="module")
def runs(lengths_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("plan_run")
    plan = _plan(tmp, lengths_file)
    path = tmp / "plan.json"
    return {
        "plan": plan,
        "path": path,
        # a launcher of its own: its import-time warnings too in the output the note test reads
        "flagless": _run(tmp / "flagless", ["--omnibal", "--omnibal-plan", str(path), *OWN],
                         fresh=True),
        "flagged": _run(tmp / "flagged", [*plan.megatron_flags, "--omnibal", "--omnibal-lengths",
                                          str(lengths_file), *OWN]),  # fmt: skip
    }


def _arg(stdout: str, name: str) -> str:
    """A value of Megatron's argument dump."""
    line = next(x for x in stdout.splitlines() if x.strip().startswith(f"{name} ."))
    return line.rsplit(" ", 1)[1]


def test_flagless_run_trains_as_the_flags_the_plan_printed(runs: dict) -> None:
    flagless, flagged = head_micro(runs["flagless"].records), head_micro(runs["flagged"].records)
    assert len(flagless) == len(flagged) == 3 * runs["plan"].parallel.micro_batches
    assert [m["indices"] for m in flagless] == [m["indices"] for m in flagged]
    assert sum(m["tokens"] for m in flagless) > 0
    assert [m["loss"] for m in flagless] == pytest.approx([m["loss"] for m in flagged], rel=1e-6)


def test_flagless_run_takes_the_plan_and_model_settings(runs: dict) -> None:
    plan, out = runs["plan"], runs["flagless"].stdout
    llm_counts = [s.num_llm_layers for s in plan.stages]
    want = {
        "tensor_model_parallel_size": "1",
        "pipeline_model_parallel_size": "2",
        "num_layers": "5",
        "hidden_size": "32",
        "num_attention_heads": "4",
        "num_query_groups": "2",
        "swiglu": "True",
        "normalization": "RMSNorm",
        "vocab_size": "128",
        "seq_length": "160",
        "micro_batch_size": "1",
        "global_batch_size": str(plan.parallel.micro_batches),
        "bf16": "True",
        "omnibal_lengths": str(plan.data.lengths_path),
        "pipeline_model_parallel_layout": "|".join(
            ("E" if r == 0 else "") + "t" * n + ("L" if r == len(llm_counts) - 1 else "")
            for r, n in enumerate(llm_counts)
        ),
    }
    assert {k: _arg(out, k) for k in want} == want
    assert sum(llm_counts) == 5 and len(set(llm_counts)) == 2  # an uneven split


def test_the_startup_summary_predicts_the_step_the_first_step_then_measures(runs: dict) -> None:
    """With a plan, rank 0's summary states the plan's predicted step (and its model TFLOP/s and
    MFU) before training; the first step's line puts the measured time beside it."""
    out, predicted = runs["flagless"].stdout, runs["plan"].predicted.step_ms
    summary = f"omnibal: plan predicted step {predicted:.1f} ms, model TFLOP/s/GPU "
    assert out.count(summary) == 1
    first = out.index("omnibal: first step measured ")
    assert out.index(summary) < first
    assert f"; plan predicted {predicted:.1f} ms, model TFLOP/s/GPU " in out[first:]


def test_fallback_notes_are_printed_once_per_run(runs: dict) -> None:
    """Without Transformer Engine and Apex, megatron-core warns from each module that falls
    back, on every rank; the run prints one note, on rank 0."""
    err = runs["flagless"].stderr
    assert err.count("pretrain_vlm: note: Transformer Engine and Apex not installed") == 1
    for noise in ("Apex is not installed", "Transformer Engine and Apex are not installed",
                  "Only transformer-engine>="):  # fmt: skip
        assert noise not in err, noise


def test_a_rescaled_batch_is_noted_once(runs: dict, tmp_path: Path) -> None:
    """--global-batch-size 8 on the plan's 2 micro-batches: one note naming both counts (the
    case then stops on a length file of another size, before any process group)."""
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"vit_num": 1, "token_num": 40, "image_flags": 1}] * 3))
    case = ["--omnibal", "--omnibal-plan", str(runs["path"]), "--omnibal-lengths", str(other),
            "--global-batch-size", "8", *OWN]  # fmt: skip
    (tmp_path / "cases.json").write_text(json.dumps([case]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "WORLD_SIZE": "2",
           "RANK": "0", "LOCAL_RANK": "0"}  # fmt: skip
    proc = subprocess.run([sys.executable, str(VALIDATE), str(tmp_path / "cases.json"),
                           str(tmp_path / "out.json")], env=env, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    (got,) = json.loads((tmp_path / "out.json").read_text())
    assert got["status"] == 2 and len(got["error"]) == 1 and "has 3 samples" in got["error"][0]
    rescaled = [n for n in got["notes"] if "micro_batches" in n]
    m = runs["plan"].parallel.micro_batches
    assert len(rescaled) == 1 and f"micro_batches={m}, this run has micro_batches=8" in rescaled[0]
