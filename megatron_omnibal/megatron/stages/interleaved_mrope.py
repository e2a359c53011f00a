"""Qwen3-VL's interleaved multimodal RoPE, which megatron-core 0.19 does not have.

Why: Qwen2.5-VL's M-RoPE gives contiguous sections of the rotary frequencies to the time,
height and width positions (megatron-core's MultimodalRotaryEmbedding). Qwen3-VL interleaves
them: frequency pair j follows the height position when j % 3 == 1 and j < 3 x section[1], the
width position when j % 3 == 2 and j < 3 x section[2], and the time position otherwise
(transformers' `Qwen3VLTextRotaryEmbedding`). The angles come out in megatron-core's layout
[S, 1, 1, head dim] (the pairs repeated for its non-interleaved rotation), so the layers apply
them as any RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pair_axes(pairs: int, section: Sequence[int]) -> torch.Tensor:
    """int64 [pairs]: the position axis (0 time, 1 height, 2 width) of each frequency pair."""
    j = torch.arange(pairs)
    axes = torch.zeros(pairs, dtype=torch.int64)
    axes[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axes


class InterleavedMRoPE(torch.nn.Module):
    """forward(position_ids [3, 1, S]) -> rotary angles [S, 1, 1, kv_channels]."""

    def __init__(self, kv_channels: int, rotary_base: float, section: Sequence[int]) -> None:
        super().__init__()
        inv_freq = 1.0 / (
            rotary_base ** (torch.arange(0, kv_channels, 2, dtype=torch.float32) / kv_channels)
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("axes", pair_axes(kv_channels // 2, section), persistent=False)

    def forward(self, position_ids: torch.Tensor, *_: object) -> torch.Tensor:
        """Extra arguments (the section megatron-core's M-RoPE takes per call) are ignored: the
        section is fixed at construction."""
        inv_freq = self.inv_freq.to(position_ids.device)
        freqs = position_ids[..., None].float() * inv_freq  # [3, 1, S, pairs]
        axes = self.axes.to(position_ids.device).expand(*freqs.shape[1:])[None]
        picked = freqs.gather(0, axes)[0]  # [1, S, pairs]
        emb = torch.cat([picked, picked], dim=-1)
        return emb.transpose(0, 1)[:, :, None, :].contiguous()
