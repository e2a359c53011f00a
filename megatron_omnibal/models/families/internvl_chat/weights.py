"""OpenGVLab's InternVL-Chat tensors (`vision_model.*`, `mlp1.*`, the LLM's own names) <->
canonical tensors: qkv fused as [Q_all; K_all; V_all], layer scale as `ls1` / `ls2`."""

from __future__ import annotations

import re

from megatron_omnibal.models.families.shared.config import HFModel
from megatron_omnibal.models.families.shared.internvit import patch_embedding_rules, qk_norm_names
from megatron_omnibal.models.families.shared.weights import (
    Rule,
    chunks_fuse,
    chunks_split,
    layer_rules,
    layers_past_feature,
    linear,
    norm,
    projector_rules,
    qkv_fuse,
    qkv_split,
)

LAYERS = re.compile(r"^vision_model\.encoder\.layers\.(\d+)\.")


def vision_rules(model: HFModel) -> list[Rule]:
    v = model.spec.vit
    ln = v.norm == "layernorm"
    heads = v.num_attention_heads
    emb = "vision_model.embeddings"
    layer = "vision_model.encoder.layers.{i}"
    rules = patch_embedding_rules(
        v, f"{emb}.class_embedding", f"{emb}.position_embedding", f"{emb}.patch_embedding"
    )
    a = f"{layer}.attn"
    names = {
        **norm("input_layernorm", f"{layer}.norm1", ln),
        **linear("self_attention.linear_qkv", (f"{a}.qkv",), v.qkv_bias),
        **linear("self_attention.linear_proj", (f"{a}.proj",), True),
        **norm("pre_mlp_layernorm", f"{layer}.norm2", ln),
        **linear("mlp.linear_fc1", (f"{layer}.mlp.fc1",), True),
        **linear("mlp.linear_fc2", (f"{layer}.mlp.fc2",), True),
        "self_attn_bda.weight": (f"{layer}.ls1",),
        "mlp_bda.weight": (f"{layer}.ls2",),
        **qk_norm_names(v, a),
    }
    fuse, split = qkv_fuse(heads, heads, v.head_dim), qkv_split(heads, heads, v.head_dim)
    attn = (chunks_fuse(fuse), chunks_split(split))
    for i in range(v.num_layers):
        rules += layer_rules("vit", i, names, attn)
    return rules


def projector(model: HFModel) -> list[Rule]:
    return projector_rules(model, "mlp1.0", "mlp1.1", "mlp1.3")


def unused(model: HFModel, name: str) -> bool:
    """Layers past the feature layer (`select_layer`)."""
    return layers_past_feature(LAYERS, name, model.spec.vit)
