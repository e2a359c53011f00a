"""The LoRA plan's memory against a measured preflight.

The oracle is the measurement: the tiny model at PP=2, each plan run by the preflight in BF16
with the training's own LoRA adapters and optimizer, once with LoRA and once in full. Per
stage, the planner's static memory by part (weights, gradients, optimizer state) matches the
bytes the preflight counts within 1%, and the LoRA run's weights, gradients and optimizer state
measure lower than the full run's. Activations are not compared: the FLOPs model's are a GPU
run's (docs/preflight.md, "LoRA: planned against measured").
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_omnibal.data.lengths import load_lengths
from megatron_omnibal.models.lora import LoraSpec
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.costs import MIB, workload_features
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.cost_model.lora_costs import static_parts_mib
from megatron_omnibal.planner.cost_model.memory import inflight_1f1b, stage_memory_mib
from megatron_omnibal.planner.make import make_plan
from megatron_omnibal.planner.plan_file.plan import save_plan
from megatron_omnibal.planner.search.request import PlanRequest
from megatron_omnibal.planner.search.setting import cost_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "helpers" / "megatron_workers"))

GIB = 2.0**30
TILES, TOKENS = 16, 160  # the runs' budgets: the largest micro-batch, one sample
LORA = LoraSpec(rank=4, alpha=8.0, dropout=0.0, targets=("linear_qkv", "linear_proj",
                                                          "linear_fc1", "linear_fc2"))  # fmt: skip
LORA_FLAGS = ["--omnibal-lora-rank", "4", "--omnibal-lora-alpha", "8",
              "--omnibal-lora-dropout", "0"]  # fmt: skip
FLAGS = ["--omnibal", "--omnibal-model", "tiny", "--omnibal-text-scale", "8",
         "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3",
         "--transformer-impl", "local", "--seed", "7", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--pipeline-model-parallel-size", "2",
         "--omnibal-precision", "bf16", "--worst-steps", "1", "--typical-steps", "1",
         "--memory-margin-gib", "0", "--device-memory-gib", "8"]  # fmt: skip


def _request(lengths_file: Path, lora: LoraSpec | None) -> PlanRequest:
    return PlanRequest(model=get_preset("tiny"), hardware=get_hardware("A100-80G"),
                       lengths=load_lengths(lengths_file), gpus=2, tp=1, pp=2,
                       micro_batches=2, global_batch=2, lengths_path=str(lengths_file),
                       lora=lora)  # fmt: skip


def _plan(path: Path, request: PlanRequest):
    plan = make_plan(request)
    plan = replace(plan, data=replace(plan.data, vit_budget=TILES, token_budget=TOKENS,
                                      pack_cost=None, levels=()))  # fmt: skip
    save_plan(plan, path)
    return plan


def _units(stage) -> list[int]:
    """The stage's partition units: ViT layers, the projector (+ LLM embedding), LLM layers."""
    vit = get_preset("tiny").vit.num_layers
    return [*range(*stage.vit_layers), *([vit] if stage.projector else []),
            *(vit + 1 + i for i in range(*stage.llm_layers))]  # fmt: skip


def planned_parts(request: PlanRequest, plan) -> list[dict[str, float]]:
    """Per stage, the planner's MiB: static parts and activations at the largest micro-batch."""
    model, lora = request.model, request.lora
    units = static_parts_mib(model, lora, 1, 1)
    costs = cost_model(request, 1, 1).at(workload_features(TILES, TOKENS, TOKENS**2))
    out = []
    for s, st in enumerate(plan.stages):
        idx = _units(st)
        lo, hi = idx[0], idx[-1] + 1
        parts = {k: float(v[idx].sum()) for k, v in units.items()}
        static = stage_memory_mib(costs, lo, hi, {0: st.vit_recompute, 1: st.llm_recompute}, 0)
        peak = stage_memory_mib(costs, lo, hi, {0: st.vit_recompute, 1: st.llm_recompute},
                                inflight_1f1b(s, 2, 2))  # fmt: skip
        parts["pinned_static"] = static - sum(parts.values())
        parts["activations"] = peak - static
        out.append(parts)
    return out


def _preflight(out: Path, flags: list[str]):
    from launch import run_local

    program = ["-m", "megatron_omnibal.preflight", *FLAGS, *flags, "--out", str(out)]
    proc = run_local(2, program, 300, cwd=out.parent)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.megatron
def test_lora_plan_memory_matches_a_measured_preflight(lengths_file, tmp_path):
    measured = {}
    for name, lora, extra in (("lora", LORA, LORA_FLAGS), ("full", None, [])):
        request = _request(lengths_file, lora)
        plan = _plan(tmp_path / f"{name}.plan.json", request)
        report = _preflight(tmp_path / f"{name}.json",
                            ["--omnibal-lengths", str(lengths_file), "--omnibal-plan",
                             str(tmp_path / f"{name}.plan.json"), *extra])  # fmt: skip
        measured[name] = [st["measured"]["static_parts_gib"] for st in report["stages"]]
        for want, got in zip(planned_parts(request, plan), measured[name], strict=True):
            got = {k: v * GIB / MIB for k, v in got.items()}
            assert sum(got.values()) == pytest.approx(
                want["weights"] + want["gradients"] + want["optimizer"] + want["pinned_static"],
                rel=1e-2)  # fmt: skip
            if lora is not None:  # the pinned patch embedding and head are frozen: weights
                want["weights"] += want.pop("pinned_static")
                for part in ("weights", "gradients", "optimizer"):
                    assert got[part] == pytest.approx(want[part], rel=1e-2), (part, got, want)
    for lora_stage, full_stage in zip(measured["lora"], measured["full"], strict=True):
        trained = [s["gradients"] + s["optimizer"] for s in (lora_stage, full_stage)]
        assert trained[0] < 0.2 * trained[1]
        assert sum(lora_stage.values()) < sum(full_stage.values())
