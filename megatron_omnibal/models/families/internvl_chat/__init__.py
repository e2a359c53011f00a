"""OpenGVLab's remote-code InternVL-Chat (`model_type` internvl_chat), what most InternVL
checkpoints on disk are: the same architecture as transformers' InternVL saved another way, so
it has no transformers class of its own (compare-hf runs its transformers-format twin)."""

from megatron_omnibal.data.text.conversations import INTERNVL_IMAGE
from megatron_omnibal.models.families.family import Family
from megatron_omnibal.models.families.internvl_chat import config, data, weights
from megatron_omnibal.models.families.shared.tiled_reference import tiled_reference
from megatron_omnibal.models.spec import ModelSpec


def claims(spec: ModelSpec) -> bool:
    """Never from a spec alone: its specs are transformers InternVL's (family internvl)."""
    return False


FAMILY = Family(
    name="internvl_chat",
    summary="OpenGVLab's remote-code InternVL-Chat",
    read_config=config.read_config,
    claims=claims,
    vision_rules=weights.vision_rules,
    projector_rules=weights.projector,
    unused=weights.unused,
    data_defaults=data.data_defaults,
    image_style=INTERNVL_IMAGE,
    reference=tiled_reference,  # run on its transformers-format twin
    transformers_class=False,
)
