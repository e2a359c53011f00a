"""transformers' forward of tiled-tower checkpoints (InternVL, LLaVA) over probe samples, one
sample per call (transformers does not pack): the oracle of `omnibal compare-hf`.

torch is imported when the oracle runs (the registry that names it is read by the planner)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from megatron_omnibal.models.families.shared.config import HFModel

if TYPE_CHECKING:
    import torch

Features = Callable[["torch.nn.Module", HFModel, "torch.Tensor"], "torch.Tensor"]


def feature_layer_output(model: torch.nn.Module, hf: HFModel, pixels: torch.Tensor
                         ) -> torch.Tensor:
    """What the projector receives [tiles, class token + patches, C]: the output of the
    feature layer (the spec's last ViT layer)."""
    out = model.model.vision_tower(pixel_values=pixels, output_hidden_states=True)
    return out.hidden_states[hf.spec.vit.num_layers]


def tiled_reference(model: torch.nn.Module, hf: HFModel, samples: Sequence[object],
                    features: Features = feature_layer_output) -> dict[str, torch.Tensor]:
    """{"logits" [S, V], "llm" [S, H] (final hidden states), "vit" [real tiles, tokens, C]}
    for samples with `tokens`, `images`, `image_flags` (megatron.batch.Sample)."""
    import torch

    logits, hidden, feats = [], [], []
    with torch.no_grad():
        for s in samples:
            real = s.images[s.image_flags.bool()]
            pixels = real if len(real) else None
            ids = s.tokens[None]
            base = model.model(input_ids=ids, pixel_values=pixels)  # the head's input, once
            logits.append(model.lm_head(base.last_hidden_state)[0])
            hidden.append(base.last_hidden_state[0])
            if pixels is not None:
                feats.append(features(model, hf, pixels))
    return {"logits": torch.cat(logits), "llm": torch.cat(hidden), "vit": torch.cat(feats)}
