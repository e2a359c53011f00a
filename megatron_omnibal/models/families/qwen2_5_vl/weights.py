"""Qwen2.5-VL's tensors (`visual.*`, the LLM's `model.*`) <-> canonical tensors: a Conv3d patch
embedding, qkv fused as [Q_all; K_all; V_all] with bias, SwiGLU with biases, RMSNorms, and its
merger as the projector."""

from __future__ import annotations

from megatron_omnibal.models.families.shared.config import HFModel
from megatron_omnibal.models.families.shared.weights import (
    Rule,
    chunks_fuse,
    chunks_split,
    layer_rules,
    linear,
    norm,
    projector_rules,
    qkv_fuse,
    qkv_split,
)


def vision_rules(model: HFModel) -> list[Rule]:
    v = model.spec.vit
    heads, layer = v.num_attention_heads, "visual.blocks.{i}"
    fuse, split = qkv_fuse(heads, heads, v.head_dim), qkv_split(heads, heads, v.head_dim)
    names = {
        **norm("input_layernorm", f"{layer}.norm1", False),
        **linear("self_attention.linear_qkv", (f"{layer}.attn.qkv",), True),
        **linear("self_attention.linear_proj", (f"{layer}.attn.proj",), True),
        **norm("pre_mlp_layernorm", f"{layer}.norm2", False),
        **linear("mlp.linear_fc1", (f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj"), True),
        **linear("mlp.linear_fc2", (f"{layer}.mlp.down_proj",), True),
    }
    rules = [Rule("patch_embed.conv.weight", ("visual.patch_embed.proj.weight",))]
    for i in range(v.num_layers):
        rules += layer_rules("vit", i, names, (chunks_fuse(fuse), chunks_split(split)))
    return rules


def projector(model: HFModel) -> list[Rule]:
    return projector_rules(model, "visual.merger.ln_q", "visual.merger.mlp.0",
                           "visual.merger.mlp.2")
