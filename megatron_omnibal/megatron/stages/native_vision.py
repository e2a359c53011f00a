"""The parts of a native-resolution vision tower (Qwen2.5-VL) that megatron-core lacks.

Why: megatron-core's ViTs see fixed-size tiles with learned position embeddings. Qwen2.5-VL's
tower sees each image whole: a Conv3d patch embedding, 2-D rotary positions, attention within
windows of merged patch groups except in a few full-attention layers (within one image), and a
patch merger after the last layer. Its layers are megatron-core TransformerLayers (TP-split,
recomputable, placed on any pipeline stage); this module adds the patch embedding, the
per-layer choice of attention mask, and the host-side inputs every stage derives from the
micro-batch's image grids (models.native_grid): the window order, the rotary positions and the
segment bounds. A video is an image of several temporal patches: full attention and windows
stay within each temporal patch, and its M-RoPE time positions follow its seconds per temporal
patch. One tensor flows between stages, the hidden states [patches, 1, C] in window order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omnibal.megatron.stages.position_table import PositionTable, position_taps
from megatron_omnibal.models.native_grid import (
    frame_seqlens,
    mrope_position_ids,
    patch_rows_cols,
    window_index,
)
from megatron_omnibal.models.spec import ModelSpec, VisionSpec


class NativePatchEmbedding(MegatronModule):
    """Patches [N, 3 x frames x pixels] -> [N, 1, C] in window order: a Conv3d whose kernel is
    one patch (with a bias where the spec says, Qwen3-VL), plus Qwen3-VL's learned position
    table resampled to each image (position_table.py) where the spec has one; replicated across
    tensor-parallel ranks."""

    def __init__(self, config: TransformerConfig, vit: VisionSpec) -> None:
        super().__init__(config=config)
        kernel = (vit.temporal_patch_size, vit.patch_size, vit.patch_size)
        self.conv = torch.nn.Conv3d(3, vit.hidden_size, kernel, stride=kernel, bias=vit.patch_bias)
        self.kernel = kernel
        self.unit = vit.spatial_merge_size**2
        with torch.no_grad():
            config.init_method(self.conv.weight)
            if self.conv.bias is not None:
                self.conv.bias.zero_()
        self.position_table = (
            PositionTable(config, vit.num_position_embeddings, vit.hidden_size)
            if vit.num_position_embeddings
            else None
        )

    def forward(self, patches: torch.Tensor, native: NativeInputs) -> torch.Tensor:
        x = self.conv(patches.to(self.conv.weight.dtype).view(-1, 3, *self.kernel))
        c = x.shape[1]
        x = x.view(-1, c)
        if self.position_table is not None:
            x = x + self.position_table(native.table_rows, native.table_weights).to(x.dtype)
        x = x.view(-1, self.unit, c).index_select(0, native.unit_order)  # window order
        return x.reshape(-1, 1, c).contiguous()


class WindowedAttention(DotProductAttention):
    """megatron-core's local attention that takes its mask from a stack of two [full, windows]
    and picks by its global layer index (`full_layers`: the full-attention layers)."""

    def __init__(self, *args: object, full_layers: tuple[int, ...], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.full = self.layer_number - 1 in full_layers

    def forward(self, query, key, value, attention_mask, *args, **kwargs):  # noqa: ANN001, ANN201
        mask = attention_mask[0:1] if self.full else attention_mask[1:2]
        return super().forward(query, key, value, mask, *args, **kwargs)


@dataclass
class NativeInputs:
    """What the stages of a native-resolution model derive from a micro-batch's image grids
    (built on the host, moved to the device once)."""

    unit_order: torch.Tensor  # int64 [units]: window order of the merged units
    unit_restore: torch.Tensor  # int64 [units]: its inverse (after the merger)
    rows_cols: torch.Tensor  # int64 [patches, 2]: rotary positions, window order
    full_bounds: torch.Tensor  # int64 [k + 1]: one segment per image frame
    window_bounds: torch.Tensor  # int64 [w + 1]: one segment per window
    mrope_ids: torch.Tensor  # int64 [3, S]: the LLM's M-RoPE positions, restarting per sample
    # Qwen3-VL's position table: the rows each patch mixes and their weights (block-major
    # order; [patches, 0] without a table)
    table_rows: torch.Tensor  # int64 [patches, 4]
    table_weights: torch.Tensor  # float32 [patches, 4]
    # Host-side (never moved): the image placeholders' positions in the sequence, int64; what
    # each stage's part of the DeepStack features is (deepstack.local_image_rows)
    image_positions: np.ndarray

    def to(self, device: torch.device | str | int) -> NativeInputs:
        """The tensors on `device` (non-blocking), the host-side arrays as they are."""
        return NativeInputs(**{
            k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
            for k, v in vars(self).items()
        })  # fmt: skip


def native_inputs(
    spec: ModelSpec,
    tokens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    image_grid: torch.Tensor,
    grid_seconds: torch.Tensor | None = None,
) -> NativeInputs:
    """NativeInputs of a micro-batch (CPU tensors, checked by validate_batch); `grid_seconds`
    spaces the M-RoPE time positions of its videos (None: images only)."""
    v = spec.vit
    merge, unit = v.spatial_merge_size, v.spatial_merge_size**2
    grids = image_grid.numpy()
    if v.windowed:
        order, windows = window_index(grids, merge, v.window_units)
    else:  # no windows: every layer sees whole image frames
        order, windows = np.arange(int(grids.prod(axis=1).sum()) // unit), frame_seqlens(grids)
    rows_cols = patch_rows_cols(grids, merge).reshape(-1, unit, 2)[order].reshape(-1, 2)
    seconds = None if grid_seconds is None else grid_seconds.numpy()
    ids = mrope_position_ids(
        tokens.numpy()[0], cu_seqlens.numpy(), grids, spec.image_token_id, merge, seconds,
        v.tokens_per_second,
    )  # fmt: skip
    if v.num_position_embeddings:
        rows, weights = position_taps(grids, v.position_table_side, merge)
    else:
        rows = np.zeros((len(rows_cols), 0), np.int64)
        weights = np.zeros((len(rows_cols), 0), np.float32)
    return NativeInputs(
        table_rows=torch.from_numpy(rows),
        table_weights=torch.from_numpy(weights),
        unit_order=torch.from_numpy(order),
        unit_restore=torch.from_numpy(np.argsort(order)),
        rows_cols=torch.from_numpy(rows_cols),
        full_bounds=torch.from_numpy(frame_seqlens(grids)),
        window_bounds=torch.from_numpy(windows),
        mrope_ids=torch.from_numpy(ids),
        image_positions=np.flatnonzero(tokens.numpy()[0] == spec.image_token_id),
    )


def segment_mask(bounds: torch.Tensor, length: int) -> torch.Tensor:
    """[1, 1, N, N] bool, True = masked: attention only within each segment of `bounds`."""
    seg = torch.repeat_interleave(
        torch.arange(len(bounds) - 1, device=bounds.device),
        bounds[1:] - bounds[:-1],
        output_size=length,
    )
    return (seg[:, None] != seg[None, :])[None, None]


def vision_rope(rows_cols: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """[N, 1, 1, head_dim] rotary angles: the first half of each head rotates by the row, the
    second by the column, each half with head_dim / 4 frequencies, repeated for megatron-core's
    non-interleaved rotation."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=rows_cols.device)
        / (head_dim // 2)
    )
    angles = (rows_cols.float()[..., None] * inv_freq).flatten(1)  # [N, head_dim / 2]
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def vision_attention_inputs(
    inputs: NativeInputs, vit: VisionSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(masks [2, 1, N, N]: full then windowed, rotary angles [N, 1, 1, head dim]) for the
    tower's layers on this stage."""
    n = inputs.rows_cols.shape[0]
    masks = torch.cat(
        [segment_mask(inputs.full_bounds, n), segment_mask(inputs.window_bounds, n)]
    )
    return masks, vision_rope(inputs.rows_cols, vit.head_dim, vit.rope_theta)
