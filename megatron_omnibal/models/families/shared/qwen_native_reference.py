"""transformers' forward of a Qwen-style native-resolution checkpoint over probe samples, one
sample per call: the last ViT block's output [patches, C] in its window order, with transformers
computing its own M-RoPE positions of each sample (`get_rope_index`), videos included.

Qwen2.5-VL positions a video's temporal patches by `second_per_grid_ts`. Qwen3-VL positions them
by the timestamp text between its frames: a video reaches the stages as one (1, h, w) grid per
temporal patch, its frames' placeholders apart, and transformers gets the same frames as videos
of one temporal patch each, which it runs and positions exactly as one video's frames (it splits
a video's grid per temporal patch itself); Qwen3VLForConditionalGeneration also raises without
`mm_token_type_ids`, text-only samples included.

torch is imported when the oracle runs (the registry that names it is read by the planner)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_omnibal.models.families.shared.config import HFModel

if TYPE_CHECKING:
    import torch


def native_reference(
    model: torch.nn.Module,
    hf: HFModel,
    samples: Sequence[object],
    *,
    frames_as_videos: bool = False,
) -> dict[str, torch.Tensor]:
    """reference() for Qwen2.5-VL samples, or with `frames_as_videos` Qwen3-VL's (`images`:
    patches, `image_grid`: (t, h, w) each; a sample whose `grid_seconds` are positive holds
    videos: transformers gets them as videos, their placeholders as its video token, and
    Qwen2.5-VL their seconds per temporal patch as `second_per_grid_ts`)."""
    import torch

    logits, hidden, feats = [], [], []
    with torch.no_grad():
        for s in samples:
            ids = s.tokens[None]
            slots = ids == hf.spec.image_token_id
            kw: dict = {"mm_token_type_ids": torch.zeros_like(ids, dtype=torch.int32)} if (
                frames_as_videos) else {}  # fmt: skip
            seconds = getattr(s, "grid_seconds", None)
            if len(s.image_grid) and seconds is not None and bool((seconds > 0).all()):
                if frames_as_videos and bool((s.image_grid[:, 0] != 1).any()):
                    raise ValueError("a Qwen3-VL video reaches the model as one (1, h, w) grid "
                                     f"per temporal patch, got grids {s.image_grid.tolist()}")
                ids = torch.where(slots, model.config.video_token_id, ids)
                kw = {"pixel_values_videos": s.images, "video_grid_thw": s.image_grid,
                      "mm_token_type_ids": slots.int() * 2}  # fmt: skip
                if not frames_as_videos:
                    kw["second_per_grid_ts"] = seconds.float()
            elif len(s.image_grid):
                kw = {"pixel_values": s.images, "image_grid_thw": s.image_grid,
                      "mm_token_type_ids": slots.int()}  # fmt: skip
            if len(s.image_grid):
                feats.append(model.model.visual(s.images, grid_thw=s.image_grid).last_hidden_state)
            base = model.model(input_ids=ids, **kw)
            logits.append(model.lm_head(base.last_hidden_state)[0])
            hidden.append(base.last_hidden_state[0])
    return {"logits": torch.cat(logits), "llm": torch.cat(hidden), "vit": torch.cat(feats)}
