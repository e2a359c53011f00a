"""transformers' Qwen3-VL (`model_type` qwen3_vl): the native-resolution tower with a learned,
interpolated position table and full attention, DeepStack (the hidden states after the tapped
ViT layers, each through its own merger, added to the LLM's image positions after its first
layers) and a Qwen3 LLM with interleaved M-RoPE."""

from functools import partial

from megatron_omnibal.data.text.conversations import QWEN_VL_IMAGE
from megatron_omnibal.models.families.family import Family
from megatron_omnibal.models.families.qwen3_vl import config, data, weights
from megatron_omnibal.models.families.shared.qwen_native import native_attention
from megatron_omnibal.models.families.shared.qwen_native_reference import native_reference
from megatron_omnibal.models.spec import ModelSpec


def claims(spec: ModelSpec) -> bool:
    """A native-resolution tower with a learned position table."""
    return spec.vit.native_resolution and spec.vit.num_position_embeddings > 0


def key_style(names: set[str], transformers_4: bool) -> weights.KeyStyle:
    """Its checkpoints (transformers 5's and the hub's alike) say `model.visual.*`,
    `model.language_model.*` and `lm_head.*`: transformers 4.5x's names, which detect_style
    maps already; its own `FILE_STYLE` for a name set without them."""
    return () if transformers_4 else weights.FILE_STYLE


FAMILY = Family(
    name="qwen3_vl",
    summary="Qwen3-VL (dense) in transformers' own classes",
    read_config=config.read_config,
    claims=claims,
    tower="native",
    vision_rules=weights.vision_rules,
    projector_rules=weights.projector,
    patch_shapes=weights.patch_shapes,
    key_style=key_style,
    data_defaults=data.data_defaults,
    image_style=QWEN_VL_IMAGE,
    dummy_tile=False,
    vit_attention=native_attention,
    reference=partial(native_reference, frames_as_videos=True),
)
