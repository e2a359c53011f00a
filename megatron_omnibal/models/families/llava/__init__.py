"""transformers' LLaVA (`model_type` llava): a CLIP tower, an MLP projector, Llama 2 / 3.x,
Mistral or Qwen LLMs; the data side also counts LLaVA-NeXT (`llava_next`, AnyRes tiles)."""

from megatron_omnibal.data.text.conversations import LLAVA_IMAGE
from megatron_omnibal.models.families.family import Family
from megatron_omnibal.models.families.llava import config, data, weights
from megatron_omnibal.models.families.shared.tiled_reference import tiled_reference
from megatron_omnibal.models.families.shared.weights import transformers_projector_rules
from megatron_omnibal.models.spec import ModelSpec


def claims(spec: ModelSpec) -> bool:
    """A tiled tower with a plain MLP projector."""
    return not spec.vit.native_resolution and spec.projector.type != "pixel_shuffle_mlp"


FAMILY = Family(
    name="llava",
    summary="LLaVA (CLIP tower) in transformers' own classes",
    read_config=config.read_config,
    claims=claims,
    vision_rules=weights.vision_rules,
    projector_rules=transformers_projector_rules,
    unused=weights.unused,
    key_style=weights.key_style,
    data_defaults=data.data_defaults,
    image_style=LLAVA_IMAGE,
    reference=tiled_reference,
    data_model_types=("llava_next",),
)
