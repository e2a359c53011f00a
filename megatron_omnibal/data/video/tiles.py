"""A video's wanted frames as tiles: decoded exactly (data/video/reader.py), each resized to
one tile (Pillow bicubic, as InternVL resizes a frame: no dynamic tiling, no thumbnail) and
normalised with the model's mean and std. The training loader and bench/bench_video.py share it, so
what the bench times is what training does."""

from __future__ import annotations

import os

import numpy as np

from megatron_omnibal.data.images.tiles import normalize
from megatron_omnibal.data.images.tiling import TilingConfig
from megatron_omnibal.data.video.reader import decode_frames


def frames_to_tiles(pixels: np.ndarray, tiling: TilingConfig) -> np.ndarray:
    """uint8 RGB frames [n, H, W, 3] -> float32 [n, 3, tile, tile]."""
    from PIL import Image

    size = tiling.tile
    resized = [np.asarray(Image.fromarray(f).resize((size, size), Image.Resampling.BICUBIC))
               for f in pixels]
    return normalize(np.stack(resized), tiling)


def video_tiles(path: str | os.PathLike, indices: np.ndarray,
                tiling: TilingConfig) -> tuple[np.ndarray, int]:
    """(float32 [len(indices), 3, tile, tile], frames decoded) of the frames `indices`."""
    decoded = decode_frames(path, indices)
    return frames_to_tiles(decoded.pixels, tiling), decoded.decoded
