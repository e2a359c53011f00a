"""Qwen3-VL's learned position table, resampled to each image's patch grid.

Why: Qwen3-VL's tower adds, besides its 2-D RoPE, a learned table of side x side positions
(2304 = 48 x 48) to the patch embeddings, bilinearly interpolated (corners aligned) to each
image's own h x w patch grid. The taps and weights of every patch depend only on the grids, so
they are found on the host with the micro-batch's other inputs (float32, in the same operation
order as transformers' `get_vision_interpolation_indices_and_weights`) and the device only
gathers and sums four table rows per patch. Patches come in the block-major order of the image
processor (merge groups of merge x merge patches), repeated for every temporal patch.
"""

from __future__ import annotations

import numpy as np
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omnibal.models.native_grid import patch_rows_cols


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """The two table rows (clamped to the table) and their weights for target positions
    `index` on axes of length `size` (align_corners: the ends map to 0 and side - 1)."""
    src = index.astype(np.float32) * np.float32(side - 1)
    src = src / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets)
    return taps, np.clip(np.float32(1) - distance, 0, None).astype(np.float32)


def position_taps(grids: np.ndarray, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows int64 [patches, 4], weights float32 [patches, 4]): the table rows each patch of
    the images (t, h, w) mixes and their bilinear weights, patches in block-major order."""
    g = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    rows_cols = patch_rows_cols(g, merge)
    counts = g.prod(axis=1)
    heights, widths = np.repeat(g[:, 1], counts), np.repeat(g[:, 2], counts)
    h_taps, h_weights = _axis_taps(rows_cols[:, 0], heights, side)
    w_taps, w_weights = _axis_taps(rows_cols[:, 1], widths, side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return index, weight


class PositionTable(torch.nn.Module):
    """The table [side^2, C]; forward(rows, weights) -> [patches, C], the weighted sum of each
    patch's rows (weights in float32, the sum cast to the table's dtype). Replicated across
    tensor-parallel ranks."""

    def __init__(self, config: TransformerConfig, num_positions: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(num_positions, hidden_size))
        with torch.no_grad():
            config.init_method(self.weight)

    def forward(self, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        mixed = (self.weight[rows] * weights[:, :, None]).sum(1)
        return mixed.to(self.weight.dtype)
