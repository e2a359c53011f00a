"""The torch side of the model families: what the stage module builds for each vision tower
kind a family names (`Family.tower`, models/families/family.py), so the stage module and the
forward step ask here instead of branching on the spec.

- "tiled" (InternViT, CLIP): one tile is the batch unit, a learned position table, every patch
  of a tile attends to every other one (no mask), Transformer Engine where available;
- "native" (Qwen2.5-VL): whole images in window order, a Conv3d patch embedding, masks (windows,
  whole images) and 2-D rotary angles derived from each micro-batch's image grids, local specs.

A new tower kind is one entry in TOWERS (and its name in models/families/family.py's TOWERS).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from megatron.core.transformer.enums import AttnMaskType

from megatron_omnibal.megatron.stages.native_vision import NativePatchEmbedding, native_inputs
from megatron_omnibal.megatron.stages.vision import PatchEmbedding
from megatron_omnibal.models.families.registry import family_of_spec
from megatron_omnibal.models.spec import ModelSpec, VisionSpec

# (spec, tokens, cu_seqlens, image_grid, grid_seconds) -> the tower's per-micro-batch inputs
AttentionInputs = Callable[
    [ModelSpec, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], Any
]


@dataclass(frozen=True, kw_only=True)
class BlockOptions:
    """How a stage's ViT layers are built: Transformer Engine or local specs, the mask type,
    the tower's own keyword arguments to layer_specs.block_spec."""

    use_te: bool
    mask_type: AttnMaskType
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class TowerHooks:
    """`patch_embedding(config, vit_spec)` builds the patch embedding; `block(vit, use_te)`
    the ViT layers' options; `attention_inputs(...)` what the stages derive from a micro-batch
    on the host (None: nothing)."""

    patch_embedding: Callable[..., torch.nn.Module]
    block: Callable[[VisionSpec, bool], BlockOptions]
    attention_inputs: AttentionInputs


def _tiled_block(v: VisionSpec, use_te: bool) -> BlockOptions:
    return BlockOptions(use_te=use_te, mask_type=AttnMaskType.no_mask)


def _native_block(v: VisionSpec, use_te: bool) -> BlockOptions:
    return BlockOptions(use_te=False, mask_type=AttnMaskType.arbitrary,
                        extra={"full_attention_layers": v.fullatt_block_indexes})


def _no_inputs(spec: ModelSpec, tokens: torch.Tensor, cu_seqlens: torch.Tensor,
               image_grid: torch.Tensor, grid_seconds: torch.Tensor | None) -> None:
    return None


TOWERS = {
    "tiled": TowerHooks(patch_embedding=PatchEmbedding, block=_tiled_block,
                        attention_inputs=_no_inputs),
    "native": TowerHooks(patch_embedding=NativePatchEmbedding, block=_native_block,
                         attention_inputs=native_inputs),
}


def tower_hooks(spec: ModelSpec) -> TowerHooks:
    """The torch hooks of the tower of `spec`'s family."""
    return TOWERS[family_of_spec(spec).tower]
