"""transformers' InternVL (`model_type` internvl): InternViT, pixel-shuffle MLP projector,
InternLM2 / Qwen2 / Qwen2.5 / Qwen3 / Llama LLMs in transformers' own classes."""

from megatron_omnibal.data.text.conversations import INTERNVL_IMAGE
from megatron_omnibal.models.families.family import Family
from megatron_omnibal.models.families.internvl import config, data, reference, weights
from megatron_omnibal.models.families.shared.weights import transformers_projector_rules
from megatron_omnibal.models.spec import ModelSpec


def claims(spec: ModelSpec) -> bool:
    """A tiled tower with a pixel-shuffle projector (InternVL-Chat's specs read the same)."""
    return not spec.vit.native_resolution and spec.projector.type == "pixel_shuffle_mlp"


FAMILY = Family(
    name="internvl",
    summary="InternVL in transformers' own classes",
    read_config=config.read_config,
    claims=claims,
    vision_rules=weights.vision_rules,
    projector_rules=transformers_projector_rules,
    unused=weights.unused,
    data_defaults=data.data_defaults,
    image_style=INTERNVL_IMAGE,
    reference=reference.reference,
)
