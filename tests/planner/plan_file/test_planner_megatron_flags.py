"""Contract with megatron.training: every flag `omnibal plan` writes into plan.json's
megatron_flags, and those of the baseline it compares with, is accepted by Megatron 0.19's real
argument parser (with our --omnibal* flags)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.data.lengths import from_arrays
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.make import make_plan
from megatron_omnibal.planner.plan_file.flags import baseline_flags
from megatron_omnibal.planner.search.request import PlanRequest

pytestmark = pytest.mark.megatron

WORKER = Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers" / "parse_flags.py"


def _parse(cases: list[list[str]], tmp: Path) -> list[dict]:
    (tmp / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp / "cases.json"), str(tmp / "out.json")],
        env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


def test_planner_flags_are_accepted_by_megatron_parser(tmp_path):
    rng = np.random.default_rng(0)
    vit = rng.integers(1, 4, 400)
    stats = from_arrays(vit, vit * 300 + rng.integers(20, 200, 400))
    hw = get_hardware("A100-80G")
    # TP=1 with RMSNorm + SwiGLU + GQA, TP=2 (sequence parallel), LayerNorm without GQA.
    # Qwen3 (head size, QK-norm), Qwen2.5 (qkv bias), Llama-3.1 (RoPE scaling).
    configs = (("internvl2-8b", 16, 1, 2), ("internvl2-8b", 16, 2, 2), ("llava-1.5-7b", 16, 2, 4),
               ("internvl3.5-8b", 16, 2, 2), ("internvl3-8b", 16, 1, 2),
               ("llava-llama3.1-8b", 16, 2, 1))  # fmt: skip
    flag_lists = []
    for name, gpus, tp, pp in configs:
        plan = make_plan(PlanRequest(model=get_preset(name), hardware=hw, lengths=stats, gpus=gpus,
                                     tp=tp, pp=pp, global_batch=64,
                                     plan_path=str(tmp_path / "plan.json")))  # fmt: skip
        flag_lists.append(list(plan.megatron_flags))
        # The best hand-set baseline's flags, less Megatron-LM's examples/multimodal
        # --recompute-vision (not a megatron.training flag).
        flag_lists.append([f for f in plan.predicted.baseline.megatron_flags
                           if f != "--recompute-vision"])  # fmt: skip
    # Qwen3-32B: 64 heads of 128 on a width of 5120 (Qwen3-8B's 32 x 128 is its width: no
    # --kv-channels needed).
    flag_lists.append(baseline_flags(get_preset("internvl3.5-38b"), 8, 4, 1, 64, (16,) * 4,
                                     True, 0))  # fmt: skip
    flag_lists[-1].remove("--recompute-vision")
    # Qwen2.5-VL-7B: M-RoPE sections (results[13]).
    flag_lists.append(baseline_flags(get_preset("qwen2.5-vl-7b"), 2, 2, 1, 64, (14, 14),
                                     False, 0))  # fmt: skip
    uneven = baseline_flags(get_preset("internvl2-8b"), 2, 4, 2, 64, (5, 9, 9, 9), True, 3)
    flag_lists.append(uneven)
    assert "--decoder-first-pipeline-num-layers" in flag_lists[-1]
    assert "--recompute-num-layers" in flag_lists[-1]
    flag_lists[-1].remove("--recompute-vision")
    interleaved = baseline_flags(get_preset("internvl2-8b"), 1, 4, 1, 64, (2, 10, 10, 10), False,
                                 1, vpp=2)  # fmt: skip
    interleaved_at = len(flag_lists)
    flag_lists.append(interleaved)
    # Qwen3-VL-30B-A3B: 128 experts of 768, top 8, over 4 expert-parallel ranks.
    moe_at = len(flag_lists)
    flag_lists.append(baseline_flags(get_preset("qwen3-vl-30b-a3b"), 1, 4, 1, 64, (12,) * 4,
                                     False, 0, ep=4))  # fmt: skip
    emitted = {f for flags in flag_lists for f in flags if f.startswith("--")}
    assert {"--sequence-parallel", "--swiglu", "--group-query-attention", "--kv-channels",
            "--qk-layernorm", "--add-qkv-bias", "--use-rope-scaling"} <= emitted
    # The control case: the parser refuses a flag megatron.training 0.19 lacks.
    results = _parse([*flag_lists, [*flag_lists[0], "--variable-seq-lengths"]], tmp_path)
    for flags, got in zip(flag_lists, results, strict=False):
        assert got["ok"], (flags, got["error"])
    chunks = [r["args"].pop("num_virtual_stages_per_pipeline_rank") for r in results[:-1]]
    assert chunks[interleaved_at] == 2  # the interleaved baseline's chunks per rank
    # The LLM as the checkpoints define it (the plan's and the baseline's flags alike).
    qwen3, qwen25, llama31 = results[6]["args"], results[8]["args"], results[10]["args"]
    assert (qwen3["kv_channels"], qwen3["qk_layernorm"], qwen3["add_qkv_bias"],
            qwen3["add_bias_linear"], qwen3["rotary_base"]) == (None, True, False, False, 1000000)
    assert qwen25["add_qkv_bias"] and not qwen25["qk_layernorm"]
    assert (llama31["use_rope_scaling"], llama31["rope_scaling_factor"], llama31["rotary_base"],
            llama31["position_embedding_type"]) == (True, 8.0, 500000, "rope")
    assert results[7]["args"] == qwen3
    assert (results[12]["args"]["kv_channels"], results[12]["args"]["qk_layernorm"]) == (128, True)
    qwen_vl = results[13]["args"]
    assert (qwen_vl["position_embedding_type"], qwen_vl["mrope_section"]) == ("mrope", [16, 24, 24])
    moe = results[moe_at]["args"]
    assert (moe["num_experts"], moe["moe_ffn_hidden_size"], moe["moe_router_topk"],
            moe["expert_model_parallel_size"], moe["moe_token_dispatcher_type"],
            moe["moe_aux_loss_coeff"], moe["moe_router_pre_softmax"]) == (
        128, 768, 8, 4, "alltoall", [0.001], False)  # fmt: skip
    assert not results[-1]["ok"] and "--variable-seq-lengths" in results[-1]["error"]
