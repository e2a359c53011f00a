"""Qwen3-VL's video rule (transformers' Qwen3VLVideoProcessor and Qwen3VLProcessor): which
frames it takes, at what size, and the timestamp text between its temporal patches.

Why its own rule: Qwen3-VL samples and sizes videos unlike Qwen2.5-VL (data/native/video.py).
It takes int(frames / rate x `fps`) frames, between `min_frames` and `max_frames` and never
more than the video has (any count: an odd one is padded with its last frame to whole temporal
patches), spread by linspace from the first to the last frame, rounded; every frame is resized
to one size by its video `smart_resize` (factor 32) whose pixel limits hold for the whole video
(`min_pixels` <= frames x height x width <= `max_pixels`, the processor's size.shortest_edge
and size.longest_edge), or with `cap_pixels_per_frame` each frame's share of the budget capped
at `max_video_tokens` merge groups. Each temporal patch of T frames is one (1, h, w) grid in the
model, its tokens after the text `<{t:.1f} seconds>` (t: the mean of its first and last frame's
time) and between `<|vision_start|>` and `<|vision_end|>`. All follows from the header alone.
"""

from __future__ import annotations

import math

import numpy as np

from megatron_omnibal.data.images.tiling import TilingError
from megatron_omnibal.data.native.video import (
    NativeVideo,
    NativeVideoError,
    NativeVideoSettings,
    native_video,
)


def frame_indices(frames: int, fps: float, settings: NativeVideoSettings, where: str
                  ) -> np.ndarray:
    """The frames Qwen3-VL takes of a video of `frames` frames at `fps` frames/s."""
    count = int(frames / fps * settings.fps)
    count = min(max(count, settings.min_frames), settings.max_frames, frames)
    if count < settings.temporal_patch_size:
        raise NativeVideoError(f"video {where}: {frames} frame(s); Qwen3-VL takes at least "
                               f"{settings.temporal_patch_size} (one temporal patch)")
    return np.linspace(0, frames - 1, count).round().astype(np.int64)


def video_resize(count: int, height: int, width: int, factor: int, temporal: int,
                 min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) of every frame: Qwen3-VL's video smart_resize (limits over all
    `count` frames)."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise TilingError(f"{width}x{height}: aspect ratio above 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(count / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(count * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (count * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def timestamps(indices: np.ndarray, fps: float, temporal: int) -> tuple[float, ...]:
    """Seconds of each temporal patch: the mean of its first and last frame's time (the last
    frame repeated to fill the last patch)."""
    idx = [int(i) for i in indices]
    idx += [idx[-1]] * (-len(idx) % temporal)
    return tuple((idx[i] / fps + idx[i + temporal - 1] / fps) / 2
                 for i in range(0, len(idx), temporal))


def timestamp_text(seconds: float) -> str:
    """The text before a temporal patch's `<|vision_start|>`."""
    return f"<{seconds:.1f} seconds>"


def qwen3_video(frames: int, fps: float, width: int, height: int,
                settings: NativeVideoSettings, factor: int, where: str) -> NativeVideo:
    """The frames, size, merge groups and timestamps of a video as Qwen3-VL takes it;
    `factor`: the merge group's side in pixels (32)."""
    indices = frame_indices(frames, fps, settings, where)
    count, step = len(indices), settings.temporal_patch_size
    most = settings.max_pixels
    if settings.cap_pixels_per_frame:
        share = max(min(settings.max_video_tokens * factor * factor, most // count),
                    int(settings.min_pixels * 1.05))
        most = share * count
    h, w = video_resize(count, height, width, factor, step, settings.min_pixels, most)
    temporal = -(-count // step)
    return NativeVideo(indices, h, w, temporal, temporal * (h // factor) * (w // factor),
                       step / fps, timestamps(indices, fps, step))


def take_video(frames: int, fps: float, width: int, height: int,
               settings: NativeVideoSettings, factor: int, where: str) -> NativeVideo:
    """A video as the model whose rule `settings.rule` names takes it (Qwen3-VL's here,
    Qwen2.5-VL's in video.py)."""
    rule = qwen3_video if settings.rule == "qwen3_vl" else native_video
    return rule(frames, fps, width, height, settings, factor, where)
