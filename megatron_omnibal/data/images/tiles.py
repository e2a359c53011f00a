"""Decode an image into the normalized pixel tiles the vision encoder runs (numpy + Pillow).

The grid comes from data/images/tiling.py, the same function `omnibal stats` counted tiles
with, so the tiles a training sample carries are exactly the vit_num of its length record.

- dynamic (InternVL): resize to the grid (bicubic), crop the tiles row by row, then a thumbnail
  of the whole image when the grid has more than one tile; ImageNet mean/std.
- fixed (LLaVA-1.5, `image_aspect_ratio: pad`): pad to a square with the mean colour, resize to
  one tile (bicubic); CLIP mean/std.

A native-resolution image (Qwen2.5-VL) is not tiled: data/native/patches.py cuts it into patches
with `normalize` from here. The tiling's own image_mean / image_std (a checkpoint's processor
settings) win over the family's.
"""

from __future__ import annotations

import io
import os
from typing import BinaryIO

import numpy as np
from PIL import Image

from megatron_omnibal.data.images.tiling import TilingConfig, dynamic_grid, image_tiles

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def normalization(config: TilingConfig) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(mean, std): the tiling's own, else those of the model family its mode belongs to."""
    clip = config.mode in ("fixed", "native")
    mean, std = (CLIP_MEAN, CLIP_STD) if clip else (IMAGENET_MEAN, IMAGENET_STD)
    return config.image_mean or mean, config.image_std or std


def tile_image(image: Image.Image, config: TilingConfig,
               images_in_sample: int = 1) -> list[Image.Image]:
    """The RGB tiles of one image of a sample holding `images_in_sample` images."""
    image = image.convert("RGB")
    tile = config.tile
    if config.mode == "fixed":
        side = max(image.size)
        mean = tuple(int(m * 255) for m in CLIP_MEAN)
        square = Image.new("RGB", (side, side), mean)
        square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        return [square.resize((tile, tile), Image.Resampling.BICUBIC)]
    if config.mode != "dynamic":
        raise ValueError(f"tiling mode {config.mode!r}: pixel tiles exist for dynamic and fixed "
                         "tiling only (native-resolution images become patches)")
    max_tiles = max(1, config.max_tiles // max(1, images_in_sample))
    cols, rows = dynamic_grid(image.width, image.height, tile, config.min_tiles, max_tiles)
    resized = image.resize((cols * tile, rows * tile), Image.Resampling.BICUBIC)
    tiles = [resized.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
             for r in range(rows) for c in range(cols)]
    if config.thumbnail and len(tiles) > 1:
        tiles.append(image.resize((tile, tile), Image.Resampling.BICUBIC))
    return tiles


class ImageDecodeError(ValueError):
    """An image that cannot be decoded: missing, truncated, corrupt, or a decompression bomb."""


def decode_image(path: str | os.PathLike) -> Image.Image:
    """The fully decoded image at `path` (every pixel read), or ImageDecodeError naming it.

    A truncated JPEG passes a header read and fails only here; Pillow refuses images over
    2x Image.MAX_IMAGE_PIXELS (decompression bombs) before decoding them.
    """
    return _decode(path, os.fspath(path))


def decode_image_bytes(data: bytes, where: str) -> Image.Image:
    """The fully decoded image held in memory (a WebDataset member); `where` names it."""
    return _decode(io.BytesIO(data), where)


def _decode(source: str | os.PathLike | BinaryIO, where: str) -> Image.Image:
    try:
        with Image.open(source) as img:
            img.load()
            return img.copy() if img.mode == "RGB" else img.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError(f"decompression bomb {where}: {exc}") from exc
    except FileNotFoundError as exc:
        raise ImageDecodeError(f"cannot read image {where}: {exc.strerror}") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageDecodeError(f"cannot decode image {where}: {exc}") from exc


def load_tiles(path: str | os.PathLike, config: TilingConfig, images_in_sample: int = 1,
               expected: int | None = None) -> np.ndarray:
    """float32 [tiles, 3, tile, tile] of the image at `path`, normalized for the encoder."""
    return image_to_tiles(decode_image(path), config, images_in_sample, expected,
                          os.fspath(path))


def image_to_tiles(img: Image.Image, config: TilingConfig, images_in_sample: int,
                   expected: int | None, where: str) -> np.ndarray:
    """float32 [tiles, 3, tile, tile] of a decoded image, normalized for the encoder.

    The count is checked against `expected` (what the length file holds), else against
    data/images/tiling.py's `image_tiles` of the decoded size.
    """
    tiles = tile_image(img, config, images_in_sample)
    if expected is None:
        expected, _ = image_tiles(img.width, img.height, config, images_in_sample)
    if len(tiles) != expected:
        raise ImageDecodeError(f"{where}: {len(tiles)} tiles from the decoded "
                               f"{img.width}x{img.height} image, the length file counts "
                               f"{expected} (the image changed since `omnibal stats`)")
    return normalize(np.stack([np.asarray(t, dtype=np.uint8) for t in tiles]), config)


def normalize(tiles: np.ndarray, config: TilingConfig) -> np.ndarray:
    """uint8 [n, H, W, 3] tiles -> float32 [n, 3, H, W], (x / 255 - mean) / std.

    Two passes over the output (a scaled copy, then the offset) instead of one per operation:
    this runs for every tile of every micro-batch.
    """
    mean, std = (np.asarray(v, np.float64) for v in normalization(config))
    scale = (1.0 / (255.0 * std)).astype(np.float32)[None, :, None, None]
    offset = (-mean / std).astype(np.float32)[None, :, None, None]
    out = np.empty((tiles.shape[0], 3, tiles.shape[1], tiles.shape[2]), np.float32)
    np.multiply(tiles.transpose(0, 3, 1, 2), scale, out=out)
    out += offset
    return out
