"""What Qwen-style native-resolution towers (Qwen2.5-VL, and the Qwen-VL towers after it) share
outside the data side: the key style of their checkpoints, the canonical shape of their Conv3d
patch embedding, and the planner's price of their attention.

A native tower's "tile" is one merge group (4 patches): its patches attend within their window
(8 x 8 patches; smaller at an image's right and bottom edges) in the windowed layers and to
every patch of their image in the `fullatt_block_indexes` layers, so a layer's attention depends
on the sizes of the images; `native_spans` prices it from the data's images.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from megatron_omnibal.models.families.family import KeyStyle, VitAttention
from megatron_omnibal.models.spec import VisionSpec

# Merge groups of an image when the data's images are unknown: transformers' Qwen2-VL image
# processor's own default max_pixels (28 x 28 x 1280), the size most fine-tuning recipes use.
DEFAULT_IMAGE_TILES = 1280


def native_tower(base: VisionSpec, vc: Any, **extra: Any) -> VisionSpec:
    """`base` (the family's fixed facts: norms, biases, MLP, positions) with the shape a Qwen
    `vision_config` gives: depth, widths, heads, patch, frames per patch and merge size (a tile
    is one merge group), and `extra`'s family-specific fields."""
    merge, patch = int(vc.spatial_merge_size), int(vc.patch_size)
    return replace(
        base,
        num_layers=int(vc.depth),
        hidden_size=int(vc.hidden_size),
        ffn_hidden_size=int(vc.intermediate_size),
        num_attention_heads=int(vc.num_heads),
        image_size=patch * merge,
        patch_size=patch,
        temporal_patch_size=int(vc.temporal_patch_size),
        spatial_merge_size=merge,
        **extra,
    )


def key_style(names: set[str], transformers_4: bool) -> KeyStyle:
    """Qwen-VL's hub checkpoints (and transformers 5's) say `model.layers.*`, `visual.*` and
    `lm_head.*`."""
    if transformers_4:
        return ()
    return (("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))


def patch_shapes(v: VisionSpec) -> dict[str, tuple[int, ...]]:
    """A Conv3d over `temporal_patch_size` frames of a patch; no position table."""
    kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)
    return {"patch_embed.conv.weight": (v.hidden_size, 3, *kernel)}


def native_attention(v: VisionSpec, image_tiles: np.ndarray | None) -> VitAttention:
    """Windowed and full spans from the data's images; the full-attention layers listed."""
    window, full = native_spans(v, image_tiles)
    return VitAttention(window_span=window, full_span=full,
                        full_layers=len(v.fullatt_block_indexes))


def native_spans(v: VisionSpec, image_tiles: np.ndarray | None) -> tuple[float, float]:
    """(windowed, full) patches a patch attends to, averaged over the patches of images of
    `image_tiles` merge groups each (None or no image: DEFAULT_IMAGE_TILES).

    Full attention: an image of N patches gives each of them N, so the mean is sum N^2 / sum N.
    Windowed: the image's grid is not known from its tile count, so each patch is priced at
    min(N, a full window): exact for images within one window or cut into whole windows, an
    upper bound for edge windows (the windowed attention is about 1% of a layer's FLOPs).
    """
    group = v.spatial_merge_size**2
    tiles = np.asarray([] if image_tiles is None else image_tiles, np.float64).ravel()
    tiles = tiles[tiles > 0]
    if not len(tiles):
        tiles = np.array([float(DEFAULT_IMAGE_TILES)])
    patches = group * tiles
    full = float((patches * patches).sum() / patches.sum())
    if not v.windowed:
        return full, full
    window = np.minimum(patches, v.window_patches**2)
    return float((patches * window).sum() / patches.sum()), full
