"""The data side of a Qwen-style native-resolution tower (Qwen2.5-VL, and the Qwen-VL towers
after it): images resized between a processor's min_pixels and max_pixels into 28 px merge
groups (one LLM token each), videos by qwen-vl-utils' frame rule (data/native/video.py).

- images: preprocessor_config.json's min_pixels and max_pixels (or its `size` shortest_edge /
  longest_edge, the newer spelling; min/max_pixels win, as in transformers), whose patch_size x
  merge_size must be the model's 28 px, and its image_mean / image_std (the OpenAI CLIP ones
  when absent); without a checkpoint directory the released processor's limits apply (3,136 to
  12,845,056 pixels);
- videos: the settings of video_preprocessor_config.json where the checkpoint has one (fps,
  min_frames, max_frames, min/max_pixels or `size`, max_video_tokens, image_mean/std; its
  patch_size x merge_size and temporal_patch_size must be the model's), else qwen-vl-utils'
  defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_omnibal.data.images.tiles import CLIP_MEAN, CLIP_STD
from megatron_omnibal.data.images.tiling import QWEN_MAX_PIXELS, QWEN_MIN_PIXELS, TilingConfig
from megatron_omnibal.data.native.video import NativeVideoSettings
from megatron_omnibal.models.families.shared.hf_files import colour


def native_tiling(pre: dict[str, Any], tile: int, tokens_per_tile: int,
                   hf_dir: str | Path | None) -> TilingConfig:
    """Qwen2.5-VL's resize limits from its preprocessor_config.json (released defaults when
    there is none); its patch x merge size must be the model's tile."""
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    low = pre.get("min_pixels", size.get("shortest_edge", QWEN_MIN_PIXELS))
    high = pre.get("max_pixels", size.get("longest_edge", QWEN_MAX_PIXELS))
    factor = int(pre.get("patch_size", 14)) * int(pre.get("merge_size", 2))
    if pre and factor != tile:
        raise ValueError(f"{hf_dir}/preprocessor_config.json: patch_size x merge_size = "
                         f"{factor} px, the model's merge group is {tile} px")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)):
        raise ValueError(f"{hf_dir}/preprocessor_config.json: min/max pixels {low!r}, {high!r} "
                         "are not integers")
    mean, std = (colour(pre, key, default, f"{hf_dir}/preprocessor_config.json")
                 for key, default in
                 (("image_mean", CLIP_MEAN), ("image_std", CLIP_STD)))
    return TilingConfig(mode="native", tile=tile, tokens_per_tile=tokens_per_tile, max_tiles=1,
                        min_pixels=low, max_pixels=high, image_mean=mean, image_std=std)


def native_video(pre: dict[str, Any], tile: int, temporal: int,
                  hf_dir: str | Path | None) -> NativeVideoSettings:
    """Qwen2.5-VL's video settings from its video_preprocessor_config.json (qwen-vl-utils'
    defaults where it has none); its patch x merge size and temporal patch must be the
    model's."""
    where = f"{hf_dir}/video_preprocessor_config.json"
    factor = int(pre.get("patch_size", 14)) * int(pre.get("merge_size", 2))
    if factor != tile or int(pre.get("temporal_patch_size", temporal)) != temporal:
        raise ValueError(f"{where}: patch_size x merge_size = {factor} px and temporal_patch_"
                         f"size {pre.get('temporal_patch_size')}, the model's are {tile} px "
                         f"and {temporal}")
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    base = NativeVideoSettings()
    values = {
        "fps": pre.get("fps") or base.fps,
        "min_frames": pre.get("min_frames", base.min_frames),
        "max_frames": pre.get("max_frames", base.max_frames),
        "min_pixels": pre.get("min_pixels", size.get("shortest_edge", base.min_pixels)),
        "max_pixels": pre.get("max_pixels", size.get("longest_edge", base.max_pixels)),
        "max_video_tokens": pre.get("max_video_tokens", base.max_video_tokens),
        "temporal_patch_size": temporal,
    }
    colours = {key: colour(pre, key, None, where) for key in ("image_mean", "image_std")
               if key in pre}
    try:
        return NativeVideoSettings(**values, **colours)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
