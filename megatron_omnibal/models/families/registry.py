"""The registry of model families: callers ask it for a family (by config.json's `model_type`,
by a checkpoint's HFModel, or by a spec with no checkpoint) instead of branching on names.

Adding a family is one folder under models/families/ holding its FAMILY and one line in
FAMILIES below (docs/models.md). The order matters twice: error messages list the families in
it, and `family_of_spec` takes the first family that claims a spec, so a family that refines
another's spec (a native tower with a position table before the plain native one) stands first.
"""

from __future__ import annotations

from megatron_omnibal.models.families import (
    internvl,
    internvl_chat,
    llava,
    qwen2_5_vl,
    qwen3_vl,
    qwen3_vl_moe,
)
from megatron_omnibal.models.families.family import Family
from megatron_omnibal.models.families.shared.config import HFModel
from megatron_omnibal.models.spec import ModelSpec

FAMILIES: tuple[Family, ...] = (
    internvl.FAMILY,
    llava.FAMILY,
    internvl_chat.FAMILY,
    qwen3_vl_moe.FAMILY,  # before qwen3_vl: it claims Qwen3-VL's towers with experts
    qwen3_vl.FAMILY,  # before qwen2_5_vl: it claims native towers with a position table
    qwen2_5_vl.FAMILY,
)
BY_NAME = {family.name: family for family in FAMILIES}
BY_DATA_TYPE = {t: family for family in FAMILIES for t in (family.name, *family.data_model_types)}


def family_named(name: str) -> Family:
    """The family of config.json's `model_type` `name` (an HFModel's `family`)."""
    if name not in BY_NAME:
        raise ValueError(f"no model family {name!r} (known: {', '.join(BY_NAME)})")
    return BY_NAME[name]


def family_of(model: HFModel) -> Family:
    """The family of a checkpoint read by read_hf."""
    return family_named(model.family)


def family_of_spec(spec: ModelSpec) -> Family:
    """The family a spec without a checkpoint belongs to: the first that claims it."""
    for family in FAMILIES:
        if family.claims(spec):
            return family
    raise ValueError(f"model {spec.name}: no model family builds its vision tower and projector "
                     f"(known: {', '.join(BY_NAME)})")


def family_for_data(model_type: object) -> Family | None:
    """The family whose data side counts a checkpoint of config.json's `model_type`."""
    return BY_DATA_TYPE.get(model_type) if isinstance(model_type, str) else None
