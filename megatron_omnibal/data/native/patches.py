"""Decode an image into the patches a native-resolution vision tower (Qwen2.5-VL) runs (numpy).

Why here and not as tiles: Qwen2.5-VL sees each image whole. Its image processor resizes the
image (bicubic) to the `smart_resize` size of data/images/tiling.py, the same function `omnibal
stats` counted the image's merge groups with, normalises it with the processor's mean and std,
repeats a still image over the `temporal` frames of the Conv3d kernel, and flattens it into
patches in the block-major order the tower reads: each merge x merge group of neighbouring
patches contiguous, groups row by row. The grid (t, h, w) in patches travels with the patches:
every pipeline stage derives the window order, the rotary positions and the M-RoPE ids from it.

A video (data/native/video.py says which frames, at what size) is decoded frame by frame at
exactly the frames taken, each resized and normalised as an image is (with the video
processor's mean and std), and every `temporal` consecutive frames make one temporal patch.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
from PIL import Image

from megatron_omnibal.data.images.tiles import ImageDecodeError, normalize
from megatron_omnibal.data.images.tiling import TilingConfig, smart_resize
from megatron_omnibal.data.native.video import NativeVideo, NativeVideoSettings
from megatron_omnibal.data.video.reader import VideoError, decode_frames


def image_patches(image: np.ndarray, patch: int, temporal: int,
                  merge: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(patches [h w, 3 x temporal x patch^2], grid (1, h, w)) of a normalised still image
    [3, H, W] whose sides are multiples of patch x merge: block-major, each patch's pixels
    repeated over the `temporal` frames of the Conv3d kernel."""
    return frame_patches(np.broadcast_to(image[None], (temporal, *image.shape)), patch,
                         temporal, merge)


def frame_patches(frames: np.ndarray, patch: int, temporal: int,
                  merge: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(patches [t h w, 3 x temporal x patch^2], grid (t, h, w)) of normalised frames
    [temporal x t, 3, H, W] whose sides are multiples of patch x merge: each temporal patch
    (`temporal` consecutive frames) block-major, one after the other."""
    n, c, height, width = frames.shape
    unit = patch * merge
    if height % unit or width % unit or n % temporal:
        raise ValueError(f"{n} frame(s) of {height}x{width} px: sides must be multiples of "
                         f"{unit}, frames of {temporal}")
    gt, gh, gw = n // temporal, height // patch, width // patch
    x = frames.reshape(gt, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [t, h/m, w/m, m, m, c, temporal, p, p]
    return (np.ascontiguousarray(x).reshape(gt * gh * gw, c * temporal * patch * patch),
            (gt, gh, gw))


def native_grid(width: int, height: int, tiling: TilingConfig,
                patch: int) -> tuple[int, int, int]:
    """The (t, h, w) patch grid of a still image of width x height pixels, from its size alone
    (what ranks that never decode the image use)."""
    h, w = smart_resize(height, width, tiling.tile, tiling.min_pixels, tiling.max_pixels)
    return 1, h // patch, w // patch


def image_to_patches(img: Image.Image, tiling: TilingConfig, patch: int, temporal: int,
                     expected: int, where: str) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(float32 patches, grid) of a decoded image, checked against `expected`, the merge
    groups the length file counts for it."""
    merge = tiling.tile // patch
    _, gh, gw = native_grid(img.width, img.height, tiling, patch)
    check_units(gh * gw // (merge * merge), expected, img.width, img.height, where)
    resized = img.convert("RGB").resize((gw * patch, gh * patch), Image.Resampling.BICUBIC)
    pixels = normalize(np.asarray(resized, dtype=np.uint8)[None], tiling)[0]
    return image_patches(pixels, patch, temporal, merge)


def check_units(units: int, expected: int, width: int, height: int, where: str) -> None:
    """ImageDecodeError unless the image's merge groups are what the length file counts."""
    if units != expected:
        raise ImageDecodeError(f"{where}: {units} merge groups from the {width}x{height} "
                               f"image, the length file counts {expected} (the image changed "
                               "since `omnibal stats`)")


def video_to_patches(path: str | os.PathLike, first: int, video: NativeVideo,
                     tiling: TilingConfig, settings: NativeVideoSettings, patch: int,
                     temporal: int, expected: int,
                     where: str) -> tuple[np.ndarray, tuple[int, int, int], int]:
    """(float32 patches, grid, frames decoded) of the frames `video` takes of the video at
    `path` (its clip starting at frame `first`), checked against `expected`, the merge groups
    the length file counts for it."""
    if video.units != expected:
        raise VideoError(f"{where}: {video.units} merge groups from the video, the length file "
                         f"counts {expected} (the video changed since `omnibal stats`)")
    decoded = decode_frames(path, first + video.indices)
    size = (video.width, video.height)
    frames = np.stack([np.asarray(Image.fromarray(f).resize(size, Image.Resampling.BICUBIC))
                       for f in decoded.pixels])
    if len(frames) % temporal:  # Qwen3-VL: the last frame fills the last temporal patch
        frames = np.concatenate([frames, frames[-1:].repeat(-len(frames) % temporal, 0)])
    colours = replace(tiling, image_mean=settings.image_mean or tiling.image_mean,
                      image_std=settings.image_std or tiling.image_std)
    patches, grid = frame_patches(normalize(frames, colours), patch, temporal,
                                  tiling.tile // patch)
    return patches, grid, decoded.decoded
