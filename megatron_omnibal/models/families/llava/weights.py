"""transformers' LLaVA tensors (a CLIP tower under `vision_tower.vision_model.*`,
`multi_modal_projector.*`) <-> canonical tensors. transformers 5 saves the tower without its
inner `vision_model.` (see key_style)."""

from __future__ import annotations

import re

from megatron_omnibal.models.families.shared.config import HFModel
from megatron_omnibal.models.families.shared.weights import (
    Rule,
    layer_rules,
    layers_past_feature,
    linear,
    norm,
    qkv_fuse,
    qkv_split,
    reshape,
)

LAYERS = re.compile(r"^vision_tower\.vision_model\.encoder\.layers\.(\d+)\.")
POST_NORM = "vision_tower.vision_model.post_layernorm."  # only on CLIP's pooled output


def vision_rules(model: HFModel) -> list[Rule]:
    v = model.spec.vit
    h, heads = v.hidden_size, v.num_attention_heads
    emb = "vision_tower.vision_model.embeddings"
    layer = "vision_tower.vision_model.encoder.layers.{i}"
    pre = "vision_tower.vision_model.pre_layrnorm"
    rules = [
        Rule("patch_embed.class_token", (f"{emb}.class_embedding",), *reshape((1, h), (h,))),
        Rule("patch_embed.position_embeddings", (f"{emb}.position_embedding.weight",)),
        Rule("patch_embed.conv.weight", (f"{emb}.patch_embedding.weight",)),
        Rule("patch_embed.pre_norm.weight", (f"{pre}.weight",)),
        Rule("patch_embed.pre_norm.bias", (f"{pre}.bias",)),
    ]
    a = f"{layer}.self_attn"
    names = {
        **norm("input_layernorm", f"{layer}.layer_norm1", True),
        **linear("self_attention.linear_qkv", (f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"),
                 True),
        **linear("self_attention.linear_proj", (f"{a}.out_proj",), True),
        **norm("pre_mlp_layernorm", f"{layer}.layer_norm2", True),
        **linear("mlp.linear_fc1", (f"{layer}.mlp.fc1",), True),
        **linear("mlp.linear_fc2", (f"{layer}.mlp.fc2",), True),
    }  # fmt: skip
    attn = (qkv_fuse(heads, heads, v.head_dim), qkv_split(heads, heads, v.head_dim))
    for i in range(v.num_layers):
        rules += layer_rules("vit", i, names, attn)
    return rules



def unused(model: HFModel, name: str) -> bool:
    """Layers past `vision_feature_layer`, and CLIP's post-LayerNorm."""
    return layers_past_feature(LAYERS, name, model.spec.vit) or name.startswith(POST_NORM)


def key_style(names: set[str], transformers_4: bool) -> tuple[tuple[str, str], ...]:
    """transformers 5 saves the CLIP tower without its inner `vision_model.`."""
    if any(".vision_model." in f".{n}" for n in names):
        return ()
    return (("vision_tower.", "vision_tower.vision_model."),)
