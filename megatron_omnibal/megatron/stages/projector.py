"""The projector: ViT patch tokens -> LLM embeddings for the real image tiles.

Why: InternVL (pixel shuffle: each 2x2 patch neighbourhood becomes one token with 4x the
channels, then LayerNorm + MLP), LLaVA (plain MLP) and Qwen2.5-VL / Qwen3-VL (patch merger:
RMSNorm or LayerNorm of each patch, each 2x2 group of a window-ordered image concatenated, MLP,
then back in image order) differ only here. The MLP is megatron-core's
(column/row parallel), so it works under tensor parallelism.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omnibal.models.spec import ModelSpec


def pixel_shuffle(x: torch.Tensor, grid: int, factor: int, version: int = 2) -> torch.Tensor:
    """[n, grid^2, C] patch tokens of n tiles -> [n, (grid/factor)^2, C factor^2].

    Each factor x factor neighbourhood of patches becomes one token, in the order transformers'
    InternVL (OpenGVLab's ps_version v2) produces; version 1 keeps ps_version v1's transposed
    grid.
    """
    n, p, c = x.shape
    if p != grid * grid or grid % factor:
        raise ValueError(
            f"pixel shuffle: {p} patches are not a {grid}x{grid} grid divisible by {factor}"
        )
    g = grid // factor
    x = x.reshape(n, grid, g, c * factor)  # fold `factor` neighbours along one side
    x = x.permute(0, 2, 1, 3).reshape(n, g, g, c * factor * factor)  # ... then the other
    if version == 2:
        x = x.permute(0, 2, 1, 3)
    return x.reshape(n, g * g, c * factor * factor)


class Projector(MegatronModule):
    """ViT hidden [cls + P, n, Cv] -> image embeddings [n_real * tokens_per_tile, H]
    (tile-major), for the real tiles only (image_flags 1)."""

    def __init__(self, config: TransformerConfig, spec: ModelSpec) -> None:
        super().__init__(config=config)
        p, v = spec.projector, spec.vit
        self.kind = p.type
        self.grid = v.grid
        self.factor = p.factor
        self.version = p.shuffle_version
        self.skip_tokens = int(v.class_token and v.drop_class_token)
        self.norm: torch.nn.Module | None = None
        if p.type == "pixel_shuffle_mlp":
            self.norm = torch.nn.LayerNorm(spec.projector_in, eps=p.norm_eps)
        elif p.type == "patch_merger":
            norm = torch.nn.LayerNorm if p.merger_norm == "layernorm" else torch.nn.RMSNorm
            self.norm = norm(v.hidden_size, eps=p.norm_eps)
        self.mlp = MLP(
            config=config,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            input_size=spec.projector_in,
        )

    def forward(self, vit_hidden: torch.Tensor, real_tiles: torch.Tensor) -> torch.Tensor:
        """Embeddings of the tiles at indices `real_tiles` (int64, found on the CPU: a boolean
        mask here would read the device back). For the patch merger, `vit_hidden` is
        [patches, 1, C] in window order and `real_tiles` the merged units' image order."""
        if self.kind == "patch_merger":
            return self._merge_patches(vit_hidden, real_tiles)
        x = vit_hidden[self.skip_tokens :].permute(1, 0, 2)  # [n, tokens, C]
        if self.kind == "pixel_shuffle_mlp":
            x = self.norm(pixel_shuffle(x, self.grid, self.factor, self.version))
        out, bias = self.mlp(x.permute(1, 0, 2))  # [t, n, H]
        if bias is not None:
            out = out + bias
        out = out.permute(1, 0, 2)  # [n, t, H]
        return out.index_select(0, real_tiles).reshape(-1, out.shape[-1])

    def _merge_patches(self, vit_hidden: torch.Tensor, unit_restore: torch.Tensor) -> torch.Tensor:
        x = self.norm(vit_hidden[:, 0])
        x = x.reshape(-1, 1, self.mlp.input_size)  # [units, 1, C merge^2]
        out, bias = self.mlp(x)
        if bias is not None:
            out = out + bias
        return out[:, 0].index_select(0, unit_restore)
