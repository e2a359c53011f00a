"""The torch side of the families: every tower kind a family may name has its hooks, and a
spec's hooks are its family's tower's (a tiled tower runs no per-micro-batch inputs)."""

from __future__ import annotations

import torch

from megatron_omnibal.megatron.stages import families as stage_families
from megatron_omnibal.megatron.stages.native_vision import NativePatchEmbedding
from megatron_omnibal.megatron.stages.vision import PatchEmbedding
from megatron_omnibal.models.families import family as family_module
from megatron_omnibal.models.families.registry import FAMILIES
from megatron_omnibal.models.presets import get_preset


def test_every_tower_a_family_may_name_has_torch_hooks() -> None:
    assert set(stage_families.TOWERS) == set(family_module.TOWERS)
    assert {family.tower for family in FAMILIES} <= set(stage_families.TOWERS)


def test_a_spec_gets_its_towers_hooks() -> None:
    tiled = stage_families.tower_hooks(get_preset("tiny"))
    native = stage_families.tower_hooks(get_preset("qwen2.5-vl-7b"))
    assert tiled.patch_embedding is PatchEmbedding
    assert native.patch_embedding is NativePatchEmbedding
    empty = torch.zeros(1, 0, dtype=torch.int64)
    assert tiled.attention_inputs(get_preset("tiny"), empty, empty[0], empty, None) is None
    v = get_preset("qwen2.5-vl-7b").vit
    block = native.block(v, True)
    assert not block.use_te and block.extra == {"full_attention_layers": v.fullatt_block_indexes}
    assert tiled.block(get_preset("tiny").vit, True).use_te
