"""transformers' InternVL tensors (`vision_tower.*`, `multi_modal_projector.*`) <-> canonical
tensors: q, k and v apart, layer scale as `lambda_1` / `lambda_2`, the final LayerNorm when the
config keeps it."""

from __future__ import annotations

import re

from megatron_omnibal.models.families.shared.config import HFModel
from megatron_omnibal.models.families.shared.internvit import patch_embedding_rules, qk_norm_names
from megatron_omnibal.models.families.shared.weights import (
    Rule,
    layer_rules,
    layers_past_feature,
    linear,
    norm,
    qkv_fuse,
    qkv_split,
)

LAYERS = re.compile(r"^vision_tower\.encoder\.layer\.(\d+)\.")
FINAL_NORM = ("vision_tower.layernorm.weight", "vision_tower.layernorm.bias")


def vision_rules(model: HFModel) -> list[Rule]:
    v = model.spec.vit
    ln = v.norm == "layernorm"
    heads = v.num_attention_heads
    emb = "vision_tower.embeddings"
    layer = "vision_tower.encoder.layer.{i}"
    conv = f"{emb}.patch_embeddings.projection"
    rules = patch_embedding_rules(v, f"{emb}.cls_token", f"{emb}.position_embeddings", conv)
    a = f"{layer}.attention"
    names = {
        **norm("input_layernorm", f"{layer}.layernorm_before", ln),
        **linear("self_attention.linear_qkv", (f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"),
                 v.qkv_bias),
        **linear("self_attention.linear_proj", (f"{a}.projection_layer",), True),
        **norm("pre_mlp_layernorm", f"{layer}.layernorm_after", ln),
        **linear("mlp.linear_fc1", (f"{layer}.mlp.fc1",), True),
        **linear("mlp.linear_fc2", (f"{layer}.mlp.fc2",), True),
        "self_attn_bda.weight": (f"{layer}.lambda_1",),
        "mlp_bda.weight": (f"{layer}.lambda_2",),
        **qk_norm_names(v, a),
    }  # fmt: skip
    if v.post_norm:
        rules += [Rule("vit_final_norm.weight", (FINAL_NORM[0],)),
                  Rule("vit_final_norm.bias", (FINAL_NORM[1],))]  # fmt: skip
    attn = (qkv_fuse(heads, heads, v.head_dim), qkv_split(heads, heads, v.head_dim))
    for i in range(v.num_layers):
        rules += layer_rules("vit", i, names, attn)
    return rules



def unused(model: HFModel, name: str) -> bool:
    """Layers past the feature layer, and the final LayerNorm where the spec has none."""
    v = model.spec.vit
    return layers_past_feature(LAYERS, name, v) or (name in FINAL_NORM and not v.post_norm)
