"""Decode an image into the patches a native-resolution vision tower (Qwen2.5-VL) runs (numpy).

Why here and not as tiles: Qwen2.5-VL sees each image whole. Its image processor resizes the
image (bicubic) to the `smart_resize` size of data/tiling.py, the same function `omnibal stats`
counted the image's merge groups with, normalises it with the processor's mean and std, repeats
a still image over the `temporal` frames of the Conv3d kernel, and flattens it into patches in
the block-major order the tower reads: each merge x merge group of neighbouring patches
contiguous, groups row by row. The grid (t, h, w) in patches travels with the patches: every
pipeline stage derives the window order, the rotary positions and the M-RoPE ids from it.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

from megatron_omnibal.data.image_tiles import ImageDecodeError, normalize
from megatron_omnibal.data.tiling import TilingConfig, smart_resize


def image_patches(image: np.ndarray, patch: int, temporal: int,
                  merge: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """(patches [h w, 3 x temporal x patch^2], grid (1, h, w)) of a normalised still image
    [3, H, W] whose sides are multiples of patch x merge: block-major, each patch's pixels
    repeated over the `temporal` frames of the Conv3d kernel."""
    c, height, width = image.shape
    unit = patch * merge
    if height % unit or width % unit:
        raise ValueError(f"image of {height}x{width} px: sides must be multiples of {unit}")
    gh, gw = height // patch, width // patch
    x = image.reshape(c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # [h/m, w/m, m, m, c, p, p]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, patch, patch))
    return x.reshape(gh * gw, c * temporal * patch * patch).copy(), (1, gh, gw)


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
