"""The projector: ViT patch tokens -> LLM embeddings for the real image tiles.

Why: InternVL (pixel shuffle: each 2x2 patch neighbourhood becomes one token with 4x the
channels, then LayerNorm + MLP) and LLaVA (plain MLP) differ only here. The MLP is megatron-core's
(column/row parallel), so it works under tensor parallelism.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def pixel_shuffle(x: torch.Tensor, grid: int, factor: int) -> torch.Tensor:
    """[P, n, C] patch tokens on a grid x grid image -> [P / factor^2, n, C * factor^2].

    Each factor x factor neighbourhood of patches is concatenated into one token.
    """
    p, n, c = x.shape
    if grid % factor:
        raise ValueError(f"pixel shuffle: grid {grid} is not a multiple of factor {factor}")
    g = grid // factor
    x = x.permute(1, 0, 2).reshape(n, g, factor, g, factor, c)
    x = x.permute(0, 1, 3, 2, 4, 5).reshape(n, g * g, factor * factor * c)
    return x.permute(1, 0, 2)


class Projector(MegatronModule):
    """ViT hidden [skip + P, n, Cv] -> image embeddings [n_real * tokens_per_tile, H]
    (tile-major); the first `skip_tokens` (a class token) are not image patches."""

    def __init__(
        self,
        config: TransformerConfig,
        kind: str,
        vit_hidden: int,
        grid: int,
        downsample: float,
        skip_tokens: int = 0,
    ) -> None:
        super().__init__(config=config)
        if kind not in ("pixel_shuffle_mlp", "mlp"):
            raise ValueError(f"projector type {kind!r}: expected 'pixel_shuffle_mlp' or 'mlp'")
        self.kind = kind
        self.grid = grid
        self.skip_tokens = skip_tokens  # leading non-patch tokens (class token) to drop
        self.factor = 1
        in_size = vit_hidden
        if kind == "pixel_shuffle_mlp":
            self.factor = round(1 / downsample)
            if abs(self.factor * downsample - 1) > 1e-6:
                raise ValueError(f"projector downsample {downsample}: must be 1/k for integer k")
            in_size = vit_hidden * self.factor**2
            self.norm = torch.nn.LayerNorm(in_size, eps=config.layernorm_epsilon)
        self.mlp = MLP(
            config=config,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            input_size=in_size,
        )

    def forward(self, vit_hidden: torch.Tensor, image_flags: torch.Tensor) -> torch.Tensor:
        x = vit_hidden[self.skip_tokens :]
        if self.kind == "pixel_shuffle_mlp":
            x = self.norm(pixel_shuffle(x, self.grid, self.factor))
        out, bias = self.mlp(x)  # [t, n, H]
        if bias is not None:
            out = out + bias
        out = out.permute(1, 0, 2)  # [n, t, H]
        real = image_flags.to(torch.bool)
        return out[real].reshape(-1, out.shape[-1])
