"""The registry of model families: every family reads its own model_type, every preset spec
belongs to the family its architecture says, unknown names are refused naming the known ones,
and the registry (read by the planner) loads no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_omnibal.models.families.registry import (
    FAMILIES,
    family_for_data,
    family_named,
    family_of_spec,
)
from megatron_omnibal.models.presets import PRESETS


def test_each_family_is_found_by_its_model_type() -> None:
    names = [family.name for family in FAMILIES]
    assert names == ["internvl", "llava", "internvl_chat", "qwen3_vl_moe", "qwen3_vl",
                     "qwen2_5_vl"]
    assert all(family_named(name).name == name for name in names)
    assert family_for_data("llava_next") is family_named("llava")
    assert family_for_data("qwen2_vl") is None and family_for_data(None) is None
    with pytest.raises(ValueError, match="no model family 'qwen2_vl' .known: internvl, llava"):
        family_named("qwen2_vl")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_belongs_to_the_family_of_its_tower_and_projector(name: str) -> None:
    """Tiled towers: InternVL's pixel shuffle or LLaVA's MLP; a native tower: a native family
    (the first that claims it, which the registry's order decides)."""
    spec = PRESETS[name]
    family = family_of_spec(spec)
    assert family.claims(spec)
    assert (family.tower == "native") == spec.vit.native_resolution
    if not spec.vit.native_resolution:
        want = "internvl" if spec.projector.type == "pixel_shuffle_mlp" else "llava"
        assert family.name == want
    assert family_of_spec(PRESETS["qwen2.5-vl-7b"]).name == "qwen2_5_vl"
    assert family_of_spec(PRESETS["qwen3-vl-8b"]).name == "qwen3_vl"
    assert family_of_spec(PRESETS["qwen3-vl-30b-a3b"]).name == "qwen3_vl_moe"


def test_the_registry_imports_no_torch() -> None:
    code = ("import sys, megatron_omnibal.models.families.registry, "
            "megatron_omnibal.planner.cost_model.flops; "
            "sys.exit(int('torch' in sys.modules or 'transformers' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
