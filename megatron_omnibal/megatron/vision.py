"""The vision patch embedding: image tiles -> ViT patch tokens.

Why separate: the patch embedding lives only on stage 0, while the ViT layers (megatron-core
TransformerLayers with bidirectional attention over one tile's patches; tiles are the batch
dimension) may span several stages and are built by the stage module.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class PatchEmbedding(MegatronModule):
    """Tiles [n, 3, H, W] -> tokens [cls + P, n, hidden] (sequence first, as Megatron expects).

    A strided convolution, an optional class token and a learned position embedding, as in
    InternViT/CLIP. Replicated across tensor-parallel ranks.
    """

    def __init__(
        self, config: TransformerConfig, image_size: int, patch_size: int, class_token: bool = False
    ) -> None:
        super().__init__(config=config)
        if image_size % patch_size:
            raise ValueError(
                f"image_size {image_size} is not a multiple of patch_size {patch_size}"
            )
        self.grid = image_size // patch_size
        self.conv = torch.nn.Conv2d(
            3, config.hidden_size, kernel_size=patch_size, stride=patch_size, bias=True
        )
        self.class_token = (
            torch.nn.Parameter(torch.empty(1, config.hidden_size)) if class_token else None
        )
        self.position_embeddings = torch.nn.Parameter(
            torch.empty(self.grid * self.grid + int(class_token), config.hidden_size)
        )
        with torch.no_grad():
            config.init_method(self.conv.weight)
            self.conv.bias.zero_()
            config.init_method(self.position_embeddings)
            if self.class_token is not None:
                config.init_method(self.class_token)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.conv(images.to(self.conv.weight.dtype))  # [n, C, g, g]
        x = x.flatten(2).permute(2, 0, 1)  # [P, n, C]
        if self.class_token is not None:
            cls = self.class_token[:, None, :].expand(1, x.shape[1], x.shape[2])
            x = torch.cat([cls, x], dim=0)
        x = x + self.position_embeddings[:, None, :]
        return x.contiguous()  # p2p sends need contiguous tensors, also with 0 tiles
