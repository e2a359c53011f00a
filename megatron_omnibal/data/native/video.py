"""Qwen2.5-VL's video rule: which frames of a video it trains on, at what size, in what grid.

Why its own rule: Qwen2.5-VL does not draw a frame count per epoch as InternVL does. Its reader
(qwen-vl-utils, which its fine-tuning code and ms-swift use) takes the video at `fps` frames per
second (2), between `min_frames` and `max_frames` and never more than the video has, an even
count (`temporal` frames, 2, make one temporal patch), spread evenly over the video
(linspace from the first to the last frame, rounded); every frame is resized by `smart_resize`
(factor 28) to between `min_pixels` and a per-frame limit: `max_pixels`, lowered so that the
whole video stays within `max_video_tokens` x 0.9 tokens' worth of pixels (each frame's share,
at least 1.05 x `min_pixels`). transformers' video processor applies the same limit with
`cap_pixels_per_frame` (integer division, as here) and the same count (for an even
`min_frames`; qwen-vl-utils rounds an odd one up, as here; transformers' float `arange` picks
other frames and sometimes one more). The frames, their size and so the sample's
tokens, T/2 x (H/28) x (W/28), follow from the video's header alone and are the same in every
epoch. The M-RoPE time step of a temporal patch is `temporal` / (the rate of the frames taken)
seconds (transformers' `second_per_grid_ts`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from megatron_omnibal.data.images.tiling import smart_resize
from megatron_omnibal.data.video.reader import VideoError

VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
MAX_VIDEO_TOKENS = 128000
RULES = ("qwen2_5_vl", "qwen3_vl")


class NativeVideoError(VideoError):
    """A video Qwen2.5-VL's rule cannot take (too few frames); the message says why."""


@dataclass(frozen=True, kw_only=True)
class NativeVideoSettings:
    """qwen-vl-utils' video settings (transformers' Qwen2-VL video processor names)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    max_video_tokens: int = MAX_VIDEO_TOKENS
    temporal_patch_size: int = 2  # frames per temporal patch (the frame count's factor)
    image_mean: tuple[float, float, float] | None = None  # None: the image processor's
    image_std: tuple[float, float, float] | None = None
    # "qwen2_5_vl" (this module's rule) or "qwen3_vl" (qwen3_video.py: min/max_pixels hold for
    # the whole video, timestamps between temporal patches)
    rule: str = "qwen2_5_vl"
    cap_pixels_per_frame: bool = False  # qwen3_vl: each frame's pixels capped (max_video_tokens)

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"video rule {self.rule!r} is not one of {RULES}")
        if not (self.fps > 0 and 1 <= self.min_frames <= self.max_frames
                and 0 < self.min_pixels <= self.max_pixels and self.max_video_tokens > 0
                and self.temporal_patch_size > 0):
            raise ValueError(f"video settings {self}: need fps > 0, 1 <= min_frames <= "
                             "max_frames, 0 < min_pixels <= max_pixels, max_video_tokens > 0, "
                             "temporal_patch_size > 0")
        for key in ("image_mean", "image_std"):
            if getattr(self, key) is not None:
                object.__setattr__(self, key, tuple(float(v) for v in getattr(self, key)))


@dataclass(frozen=True)
class NativeVideo:
    """What a video becomes: the frames taken (indices into the clip), their size in pixels,
    temporal patches, merge groups (= LLM tokens) and seconds per temporal patch."""

    indices: np.ndarray  # int64 [frames]
    height: int
    width: int
    temporal: int  # temporal patches: frames / temporal_patch_size
    units: int
    seconds_per_grid: float
    timestamps: tuple[float, ...] = ()  # Qwen3-VL: seconds of each temporal patch (its text)

    def grid(self, patch: int) -> tuple[int, int, int]:
        """(t, h, w) in patches of `patch` px."""
        return self.temporal, self.height // patch, self.width // patch


def frame_count(frames: int, fps: float, settings: NativeVideoSettings, where: str) -> int:
    """Frames taken of a video of `frames` frames at `fps` frames/s (qwen-vl-utils'
    smart_nframes, transformers' sample_frames with fps)."""
    step = settings.temporal_patch_size
    low = math.ceil(settings.min_frames / step) * step
    high = math.floor(min(settings.max_frames, frames) / step) * step
    count = min(max(frames / fps * settings.fps, low), high, frames)
    count = math.floor(count / step) * step
    if count < step:
        raise NativeVideoError(f"video {where}: {frames} frame(s); Qwen2.5-VL takes at least "
                               f"{step} (one temporal patch)")
    return count


def native_video(frames: int, fps: float, width: int, height: int,
                 settings: NativeVideoSettings, factor: int, where: str) -> NativeVideo:
    """The frames, size and tokens of a video (of `frames` frames at `fps`, `width` x `height`
    pixels) as Qwen2.5-VL takes it; `factor`: the merge group's side in pixels (28)."""
    count = frame_count(frames, fps, settings, where)
    indices = np.rint(np.linspace(0, frames - 1, count)).astype(np.int64)
    step = settings.temporal_patch_size
    budget = int(settings.max_video_tokens * factor * factor * 0.9)
    most = max(min(settings.max_pixels, budget * step // count),
               int(settings.min_pixels * 1.05))
    h, w = smart_resize(height, width, factor, settings.min_pixels, most)
    temporal = count // step
    sampled_fps = count / frames * fps
    return NativeVideo(indices, h, w, temporal, temporal * (h // factor) * (w // factor),
                       step / sampled_fps)
