"""transformers' own forward of a checkpoint: the oracle for `omnibal compare-hf`.

Why per sample: transformers runs one sample per sequence (no packing), so the packed Megatron
micro-batch is compared with the concatenation of each sample's own forward. The ViT features
are what transformers' model feeds its projector (`vision_feature_layer`, a final LayerNorm where
the config has one), before the class token is dropped; for Qwen2.5-VL the last block's output
[patches, C] in its window order, with transformers computing its own M-RoPE positions of each
sample (`get_rope_index`), videos included.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_omnibal.models.hf_config import HFConfigError, HFModel

NATIVE = ("internvl", "llava", "qwen2_5_vl")  # families with transformers' own classes


def load_model(hf: HFModel) -> torch.nn.Module:
    """The checkpoint in transformers' own class, in fp32, eval mode."""
    if hf.family not in NATIVE:
        raise HFConfigError(
            f"{hf.path}: a {hf.family} checkpoint runs only with its own remote code; compare "
            "its transformers-format twin (model_type internvl) instead"
        )
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        Path(hf.path), dtype=torch.float32, local_files_only=True
    )
    return model.eval()


def vision_features(model: torch.nn.Module, hf: HFModel, pixels: torch.Tensor) -> torch.Tensor:
    """What the projector receives [tiles, class token + patches, C]."""
    tower = model.model.vision_tower
    out = tower(pixel_values=pixels, output_hidden_states=True)
    if hf.family == "internvl" and hf.spec.vit.num_layers == hf.vit_checkpoint_layers:
        return out.last_hidden_state  # includes the final LayerNorm where there is one
    return out.hidden_states[hf.spec.vit.num_layers]


def reference(
    model: torch.nn.Module, hf: HFModel, samples: Sequence[object]
) -> dict[str, torch.Tensor]:
    """{"logits" [S, V], "llm" [S, H] (final hidden states), "vit" [real tiles, tokens, C]}
    for samples with `tokens`, `images`, `image_flags` (megatron.batch.Sample)."""
    if hf.family == "qwen2_5_vl":
        return _reference_native(model, hf, samples)
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
                feats.append(vision_features(model, hf, pixels))
    return {"logits": torch.cat(logits), "llm": torch.cat(hidden), "vit": torch.cat(feats)}


def _reference_native(
    model: torch.nn.Module, hf: HFModel, samples: Sequence[object]
) -> dict[str, torch.Tensor]:
    """reference() for Qwen2.5-VL samples (`images`: patches, `image_grid`: (t, h, w) each; a
    sample whose `grid_seconds` are positive holds videos: transformers gets them as videos,
    their placeholders as its video token, their seconds per temporal patch as
    `second_per_grid_ts`)."""
    logits, hidden, feats = [], [], []
    with torch.no_grad():
        for s in samples:
            ids = s.tokens[None]
            kw = {}
            slots = ids == hf.spec.image_token_id
            seconds = getattr(s, "grid_seconds", None)
            if len(s.image_grid) and seconds is not None and bool((seconds > 0).all()):
                ids = torch.where(slots, model.config.video_token_id, ids)
                kw = {"pixel_values_videos": s.images, "video_grid_thw": s.image_grid,
                      "second_per_grid_ts": seconds.float(),
                      "mm_token_type_ids": slots.int() * 2}  # fmt: skip
            elif len(s.image_grid):
                kw = {"pixel_values": s.images, "image_grid_thw": s.image_grid,
                      "mm_token_type_ids": slots.int()}  # fmt: skip
            if len(s.image_grid):
                feats.append(model.model.visual(s.images, grid_thw=s.image_grid).last_hidden_state)
            base = model.model(input_ids=ids, **kw)
            logits.append(model.lm_head(base.last_hidden_state)[0])
            hidden.append(base.last_hidden_state[0])
    return {"logits": torch.cat(logits), "llm": torch.cat(hidden), "vit": torch.cat(feats)}
