"""transformers' forward of a Qwen3-VL checkpoint over probe samples, one sample per call, with
its own 3-D positions (`get_rope_index`, which Qwen3VLForConditionalGeneration computes from
`mm_token_type_ids`: it raises without them).

A video reaches the stages as one (1, h, w) grid per temporal patch, its frames' placeholders
apart (timestamp text between them, as Qwen3VLProcessor renders it); transformers gets the same
frames as videos of one temporal patch each, which it runs and positions exactly as it does one
video's frames (it splits a video's grid per temporal patch itself). torch is imported when the
oracle runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_omnibal.models.families.shared.config import HFModel

if TYPE_CHECKING:
    import torch


def reference(model: torch.nn.Module, hf: HFModel, samples: Sequence[object]
              ) -> dict[str, torch.Tensor]:
    """{"logits", "llm": the last hidden states, "vit": the last ViT layer's output [patches,
    C]} over `samples` (`images` patches, `image_grid` (t, h, w) each; positive `grid_seconds`:
    the grids are video frames)."""
    import torch

    logits, hidden, feats = [], [], []
    with torch.no_grad():
        for s in samples:
            ids = s.tokens[None]
            slots = ids == hf.spec.image_token_id
            kw: dict = {"mm_token_type_ids": torch.zeros_like(ids, dtype=torch.int32)}
            seconds = getattr(s, "grid_seconds", None)
            if len(s.image_grid) and seconds is not None and bool((seconds > 0).all()):
                if bool((s.image_grid[:, 0] != 1).any()):
                    raise ValueError("a Qwen3-VL video reaches the model as one (1, h, w) grid "
                                     f"per temporal patch, got grids {s.image_grid.tolist()}")
                ids = torch.where(slots, model.config.video_token_id, ids)
                kw = {"pixel_values_videos": s.images, "video_grid_thw": s.image_grid,
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
