"""The vision patch embedding: image tiles -> ViT patch tokens.

Why separate: the patch embedding lives only on stage 0, while the ViT layers (megatron-core
TransformerLayers with bidirectional attention over one tile's patches; tiles are the batch
dimension) may span several stages and are built by the stage module.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omnibal.models.spec import VisionSpec


class PatchEmbedding(MegatronModule):
    """Tiles [n, 3, H, W] -> tokens [cls + P, n, hidden] (sequence first, as Megatron expects).

    A strided convolution (with a bias for InternViT, without for CLIP), an optional class
    token, a learned position embedding and, for CLIP, a LayerNorm before the first layer
    (`pre_layrnorm`). Replicated across tensor-parallel ranks.
    """

    def __init__(self, config: TransformerConfig, vit: VisionSpec) -> None:
        super().__init__(config=config)
        self.grid = vit.grid
        self.conv = torch.nn.Conv2d(
            3, vit.hidden_size, kernel_size=vit.patch_size, stride=vit.patch_size,
            bias=vit.patch_bias,
        )  # fmt: skip
        self.class_token = (
            torch.nn.Parameter(torch.empty(1, vit.hidden_size)) if vit.class_token else None
        )
        self.position_embeddings = torch.nn.Parameter(
            torch.empty(vit.seq_per_tile, vit.hidden_size)
        )
        self.pre_norm = (
            torch.nn.LayerNorm(vit.hidden_size, eps=vit.norm_eps) if vit.pre_norm else None
        )
        with torch.no_grad():
            config.init_method(self.conv.weight)
            if self.conv.bias is not None:
                self.conv.bias.zero_()
            config.init_method(self.position_embeddings)
            if self.class_token is not None:
                config.init_method(self.class_token)
        # With one tile the class token's and the position embedding's gradients are views of
        # one tensor, and torch's accumulation may keep such a view as the .grad: a later
        # micro-batch summed into one would change the other (without Megatron's DDP, which
        # moves each .grad into its buffer at once). Each gets a copy of its own.
        for param in (self.class_token, self.position_embeddings):
            if param is not None:
                param.register_hook(torch.clone)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv(images.to(self.conv.weight.dtype))  # [n, C, g, g]
        x = x.flatten(2).permute(2, 0, 1)  # [P, n, C]
        if self.class_token is not None:
            cls = self.class_token[:, None, :].expand(1, x.shape[1], x.shape[2])
            x = torch.cat([cls, x], dim=0)
        x = x + self.position_embeddings[:, None, :]
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        return x.contiguous()  # p2p sends need contiguous tensors, also with 0 tiles
