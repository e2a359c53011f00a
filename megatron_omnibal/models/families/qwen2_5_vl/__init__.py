"""transformers' Qwen2.5-VL (`model_type` qwen2_5_vl): the native-resolution tower (windowed and
full attention, 2-D RoPE), the patch merger, a Qwen2 LLM with M-RoPE."""

from megatron_omnibal.data.text.conversations import QWEN_VL_IMAGE
from megatron_omnibal.models.families.family import Family
from megatron_omnibal.models.families.qwen2_5_vl import config, data, weights
from megatron_omnibal.models.families.shared.qwen_native import (
    key_style,
    native_attention,
    patch_shapes,
)
from megatron_omnibal.models.families.shared.qwen_native_reference import native_reference
from megatron_omnibal.models.spec import ModelSpec


def claims(spec: ModelSpec) -> bool:
    """A native-resolution tower."""
    return spec.vit.native_resolution


FAMILY = Family(
    name="qwen2_5_vl",
    summary="Qwen2.5-VL in transformers' own classes",
    read_config=config.read_config,
    claims=claims,
    tower="native",
    vision_rules=weights.vision_rules,
    projector_rules=weights.projector,
    patch_shapes=patch_shapes,
    key_style=key_style,
    data_defaults=data.data_defaults,
    image_style=QWEN_VL_IMAGE,
    dummy_tile=False,
    vit_attention=native_attention,
    reference=native_reference,
)
