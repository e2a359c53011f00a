"""transformers' Qwen3-VL-MoE (`model_type` qwen3_vl_moe; Qwen3-VL-30B-A3B, -235B-A22B):
Qwen3-VL's tower, DeepStack and interleaved M-RoPE (the qwen3_vl family's hooks) with a
Qwen3-MoE LLM whose experts are stored fused (`mlp.experts.gate_up_proj` / `down_proj`)."""

from dataclasses import replace

from megatron_omnibal.models.families import qwen3_vl
from megatron_omnibal.models.families.qwen3_vl_moe import config
from megatron_omnibal.models.families.shared.weights import fused_expert_rules
from megatron_omnibal.models.spec import ModelSpec


def claims(spec: ModelSpec) -> bool:
    """Qwen3-VL's tower with a mixture-of-experts LLM."""
    return qwen3_vl.FAMILY.claims(spec) and spec.llm.is_moe


FAMILY = replace(
    qwen3_vl.FAMILY,
    name="qwen3_vl_moe",
    summary="Qwen3-VL-MoE in transformers' own classes",
    read_config=config.read_config,
    claims=claims,
    expert_rules=fused_expert_rules,
)
