"""transformers' InternVL forward as compare-hf's oracle: the tiled forward, whose ViT features
include the final LayerNorm when the spec runs every layer of the checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_omnibal.models.families.shared.config import HFModel
from megatron_omnibal.models.families.shared.tiled_reference import (
    feature_layer_output,
    tiled_reference,
)

if TYPE_CHECKING:
    import torch


def vision_features(model: torch.nn.Module, hf: HFModel, pixels: torch.Tensor) -> torch.Tensor:
    """What the projector receives [tiles, class token + patches, C]."""
    if hf.spec.vit.num_layers != hf.vit_checkpoint_layers:
        return feature_layer_output(model, hf, pixels)
    out = model.model.vision_tower(pixel_values=pixels, output_hidden_states=True)
    return out.last_hidden_state  # includes the final LayerNorm where there is one


def reference(model: torch.nn.Module, hf: HFModel, samples: Sequence[object]
              ) -> dict[str, torch.Tensor]:
    return tiled_reference(model, hf, samples, vision_features)
