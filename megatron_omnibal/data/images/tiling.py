"""How many tiles the vision encoder sees for an image, and how many LLM tokens they become.

Four schemes, each computed from the image size alone, the way the models' preprocessors do it:

- InternVL dynamic resolution: the image is resized to the grid of `tile` squares whose aspect
  ratio is closest to the image's, among grids of `min_tiles..max_tiles` tiles; on an exact tie
  the larger grid wins when the image has more than half of its pixels. A thumbnail tile is added
  when the grid has more than one tile. Every tile gives `tokens_per_tile` tokens (256 for a
  448 tile, 14-pixel patches and pixel shuffle 0.5).
- LLaVA-1.5 fixed resize: one tile of `tokens_per_tile` tokens (576 for CLIP-L/336).
- LLaVA-NeXT AnyRes: the grid resolution (from `pinpoints`) that keeps the most image pixels,
  then the least waste; tiles = the grid's tiles + one base tile. Tokens as LLaVA-NeXT feeds the
  LLM: the base tile's features, the grid's features with the padding rows (or columns) removed,
  and one newline token per remaining feature row.
- Qwen2.5-VL native resolution: the image is resized by the processor's `smart_resize` to a
  multiple of `tile` (28 px: 14 px patches merged 2x2) per side, with between `min_pixels` and
  `max_pixels` pixels; a tile is one 28 px merge group, 4 patches, one LLM token, so an image
  of H' x W' pixels after the resize is (H'/28)(W'/28) tiles and tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

# LLaVA-NeXT (v1.6) grid resolutions, (height, width) as in its `image_grid_pinpoints`.
DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
# Qwen2.5-VL's released preprocessor_config.json: 56 x 56 to 28 x 28 x 16384 pixels (4 to
# 16,384 tokens per image).
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 16384
MAX_ASPECT_RATIO = 200  # smart_resize refuses longer sides


class TilingError(ValueError):
    """An image the model's preprocessing refuses (Qwen2.5-VL: aspect ratio above 200)."""


MODES = ("dynamic", "fixed", "anyres", "native")


@dataclass(frozen=True)
class TilingConfig:
    """The vision side of a model: how images become tiles and tiles become tokens.

    `mode` is "dynamic" (InternVL), "fixed" (LLaVA-1.5), "anyres" (LLaVA-NeXT) or "native"
    (Qwen2.5-VL: tiles of `tile` px from an image resized to between `min_pixels` and
    `max_pixels` pixels). `pinpoints`
    are (height, width) grid resolutions for anyres, in the order of the Hugging Face config's
    `image_grid_pinpoints` (the first of equal candidates wins); `features_per_side` is the
    per-tile feature grid side of anyres (tile // patch size: 24 for CLIP-L/336).
    `image_mean` and `image_std` normalise the pixels (the checkpoint's image processor's; None:
    the family's usual ones).
    """

    mode: str = "dynamic"
    tile: int = 448
    min_tiles: int = 1
    max_tiles: int = 12
    thumbnail: bool = True
    tokens_per_tile: int = 256
    pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS
    features_per_side: int = 24
    min_pixels: int = QWEN_MIN_PIXELS
    max_pixels: int = QWEN_MAX_PIXELS
    image_mean: tuple[float, float, float] | None = None
    image_std: tuple[float, float, float] | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"tiling mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.tile <= 0 or self.tokens_per_tile <= 0:
            raise ValueError("tile size and tokens per tile must be positive")
        if not 1 <= self.min_tiles <= self.max_tiles:
            raise ValueError(f"need 1 <= min_tiles <= max_tiles, got {self.min_tiles}, "
                             f"{self.max_tiles}")
        if self.mode == "anyres":
            if not self.pinpoints:
                raise ValueError("anyres needs at least one pinpoint")
            for h, w in self.pinpoints:
                if w <= 0 or h <= 0 or w % self.tile or h % self.tile:
                    raise ValueError(f"anyres pinpoint {h}x{w} (height x width) is not a "
                                     f"multiple of the tile size {self.tile}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if value is not None and (len(value) != 3 or not all(
                    math.isfinite(v) for v in value)):
                raise ValueError(f"{name} must be three finite numbers (R, G, B), got {value!r}")
        if self.image_std is not None and min(self.image_std) <= 0:
            raise ValueError(f"image_std must be positive, got {self.image_std!r}")
        if self.mode == "native" and not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"native tiling needs 0 < min_pixels <= max_pixels, got "
                             f"{self.min_pixels}, {self.max_pixels}")


def image_tiles(width: int, height: int, config: TilingConfig,
                images_in_sample: int = 1) -> tuple[int, int]:
    """(tiles, LLM image tokens) for one image of a sample holding `images_in_sample` images.

    InternVL shares the tile budget among a sample's images: each gets
    max(1, max_tiles // images) tiles at most.
    """
    if config.mode == "dynamic":
        max_tiles = max(1, config.max_tiles // max(1, images_in_sample))
        tiles = dynamic_tiles(width, height, config.tile, config.min_tiles, max_tiles,
                              config.thumbnail)
        return tiles, tiles * config.tokens_per_tile
    if config.mode == "fixed":
        return 1, config.tokens_per_tile
    if config.mode == "native":
        h, w = smart_resize(height, width, config.tile, config.min_pixels, config.max_pixels)
        tiles = (h // config.tile) * (w // config.tile)
        return tiles, tiles * config.tokens_per_tile
    grid_h, grid_w = anyres_resolution(width, height, config.pinpoints)
    tiles = (grid_w // config.tile) * (grid_h // config.tile) + 1
    tokens = anyres_tokens(width, height, grid_w // config.tile, grid_h // config.tile,
                           config.features_per_side)
    return tiles, tokens


@lru_cache(maxsize=1 << 16)
def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = QWEN_MIN_PIXELS,
                 max_pixels: int = QWEN_MAX_PIXELS) -> tuple[int, int]:
    """(height, width) Qwen2.5-VL's image processor resizes an image to: each side rounded to
    a multiple of `factor` (Python's round, halves to even), then scaled down (sides floored,
    at least `factor`) to at most `max_pixels` or up (sides ceiled) to at least `min_pixels`,
    keeping the aspect ratio as well as the multiples allow."""
    if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
        raise TilingError(f"{width}x{height} pixels: aspect ratio above {MAX_ASPECT_RATIO}, "
                          "which Qwen2.5-VL's image processor refuses")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@lru_cache(maxsize=64)
def dynamic_grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """All (columns, rows) grids of min..max tiles, fewest tiles first, then fewest columns.

    Empty when min > max (a multi-image share below min_tiles): the image then gets one tile,
    as in InternVL.
    """
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles // c + 1)
             if c * r >= min_tiles]
    return tuple(sorted(grids, key=lambda g: (g[0] * g[1], g[0])))


@lru_cache(maxsize=1 << 16)
def dynamic_grid(width: int, height: int, tile: int, min_tiles: int,
                 max_tiles: int) -> tuple[int, int]:
    """The (columns, rows) grid InternVL resizes an image to.

    Closest aspect ratio wins; on an exact tie, a later (larger) grid replaces the earlier one
    only while the image area exceeds half the grid's pixel area, so small images stay on
    small grids.
    """
    aspect = width / height
    area = width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in dynamic_grids(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


def dynamic_tiles(width: int, height: int, tile: int = 448, min_tiles: int = 1,
                  max_tiles: int = 12, thumbnail: bool = True) -> int:
    """Tiles InternVL's dynamic preprocessing makes of a width x height image."""
    cols, rows = dynamic_grid(width, height, tile, min_tiles, max_tiles)
    tiles = cols * rows
    return tiles + 1 if thumbnail and tiles > 1 else tiles


@lru_cache(maxsize=1 << 16)
def anyres_resolution(width: int, height: int,
                      pinpoints: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The (height, width) pinpoint LLaVA-NeXT picks: most image pixels kept, then least waste.

    Pixels kept: those of the image downscaled (never upscaled in the count) to fit the grid.
    """
    best, best_kept, best_waste = pinpoints[0], -1, 0
    for grid_h, grid_w in pinpoints:
        scale = min(grid_w / width, grid_h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = grid_w * grid_h - kept
        if kept > best_kept or (kept == best_kept and waste < best_waste):
            best, best_kept, best_waste = (grid_h, grid_w), kept, waste
    return best


def anyres_tokens(width: int, height: int, grid_cols: int, grid_rows: int,
                  features_per_side: int = 24) -> int:
    """LLM tokens of a LLaVA-NeXT image: base tile + unpadded grid features + row newlines.

    The resized image is padded to the grid; LLaVA-NeXT drops the feature rows (or columns)
    that hold only padding, then appends a newline embedding to every remaining row.
    """
    feat_w, feat_h = features_per_side * grid_cols, features_per_side * grid_rows
    if width / height > feat_w / feat_h:  # wider than the grid: padding above and below
        kept = int(round(height * (feat_w / width), 7))
        feat_h -= 2 * ((feat_h - kept) // 2)
    else:
        kept = int(round(width * (feat_h / height), 7))
        feat_w -= 2 * ((feat_w - kept) // 2)
    return features_per_side**2 + feat_w * feat_h + feat_h
