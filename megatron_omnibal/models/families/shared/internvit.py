"""InternViT, the tower of transformers' `internvl` and OpenGVLab's `internvl_chat` alike: what
both families share of its config, weight names (they differ only in the names) and data side.

Why shared: the two families are one architecture saved two ways, so a fix to the tower's
reading holds for both.
"""

from __future__ import annotations

from megatron_omnibal.data.images.tiling import TilingConfig
from megatron_omnibal.models.families.family import DataDefaults
from megatron_omnibal.models.families.shared.weights import Rule, reshape
from megatron_omnibal.models.spec import ModelSpec, VisionSpec

INTERNVIT_NORMS = {"layer_norm": "layernorm", "rms_norm": "rmsnorm"}  # config.json's norm_type
TEMPLATE = "internvl2_5"


def default_data(spec: ModelSpec) -> DataDefaults:
    """InternVL's data side without a checkpoint directory: dynamic tiles (1 to 12 and a
    thumbnail), the internvl2_5 template."""
    tiling = TilingConfig(mode="dynamic", tile=spec.vit.image_size,
                          tokens_per_tile=spec.tokens_per_tile)
    return DataDefaults(tiling=tiling, template=TEMPLATE)


def patch_embedding_rules(v: VisionSpec, cls: str, positions: str, conv: str) -> list[Rule]:
    """An InternViT tower's patch embedding under its HF names: class token, position table,
    convolution."""
    h, seq = v.hidden_size, v.seq_per_tile
    return [
        Rule("patch_embed.class_token", (cls,), *reshape((1, h), (1, 1, h))),
        Rule("patch_embed.position_embeddings", (positions,), *reshape((seq, h), (1, seq, h))),
        Rule("patch_embed.conv.weight", (f"{conv}.weight",)),
        Rule("patch_embed.conv.bias", (f"{conv}.bias",)),
    ]


def qk_norm_names(v: VisionSpec, attention: str) -> dict[str, tuple[str, ...]]:
    """InternViT-6B's QK-norm weights (over all heads at once) under the attention module
    `attention`; none without QK-norm."""
    if not v.qk_norm:
        return {}
    return {
        "self_attention.q_layernorm.weight": (f"{attention}.q_norm.weight",),
        "self_attention.k_layernorm.weight": (f"{attention}.k_norm.weight",),
    }
