"""transformers' forward of a Qwen-style native-resolution checkpoint over probe samples, one
sample per call: the last ViT block's output [patches, C] in its window order, with transformers
computing its own M-RoPE positions of each sample (`get_rope_index`), videos included.

torch is imported when the oracle runs (the registry that names it is read by the planner)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from megatron_omnibal.models.families.shared.config import HFModel

if TYPE_CHECKING:
    import torch


def native_reference(
    model: torch.nn.Module, hf: HFModel, samples: Sequence[object]
) -> dict[str, torch.Tensor]:
    """reference() for Qwen2.5-VL samples (`images`: patches, `image_grid`: (t, h, w) each; a
    sample whose `grid_seconds` are positive holds videos: transformers gets them as videos,
    their placeholders as its video token, their seconds per temporal patch as
    `second_per_grid_ts`)."""
    import torch

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
