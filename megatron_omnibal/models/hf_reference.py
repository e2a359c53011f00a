"""transformers' own forward of a checkpoint: the oracle for `omnibal compare-hf`.

Why per sample: transformers runs one sample per sequence (no packing), so the packed Megatron
micro-batch is compared with the concatenation of each sample's own forward. The ViT features
are what transformers' model feeds its projector (`vision_feature_layer`, a final LayerNorm where
the config has one), before the class token is dropped; for Qwen2.5-VL the last block's output
[patches, C] in its window order, with transformers computing its own M-RoPE positions of each
sample (`get_rope_index`), videos included. Each family's forward is its `reference` hook
(models/families/); a family without a transformers class of its own (remote code only) is
compared through its transformers-format twin.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_omnibal.models.families.registry import family_of
from megatron_omnibal.models.hf_config import HFConfigError, HFModel


def load_model(hf: HFModel) -> torch.nn.Module:
    """The checkpoint in transformers' own class, in fp32, eval mode."""
    if not family_of(hf).transformers_class:
        raise HFConfigError(
            f"{hf.path}: a {hf.family} checkpoint runs only with its own remote code; compare "
            "its transformers-format twin (model_type internvl) instead"
        )
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        Path(hf.path), dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def reference(
    model: torch.nn.Module, hf: HFModel, samples: Sequence[object]
) -> dict[str, torch.Tensor]:
    """{"logits" [S, V], "llm" [S, H] (final hidden states), "vit" [real tiles, tokens, C]}
    for samples with `tokens`, `images`, `image_flags` (megatron.batch.Sample); a native
    tower's samples also carry `image_grid` (and `grid_seconds`), its "vit" is [patches, C]."""
    return family_of(hf).reference(model, hf, samples)
