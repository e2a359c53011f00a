"""Model FLOPs of a VLM's parts per unit of work: one formula for the planner's analytic costs
and the training log's model TFLOP/s and MFU.

Matrix multiplies only, 2 FLOPs per multiply-add. Every tile's patches attend to each other;
LLM attention is causal within each packed sample, so it costs sum(L^2) over the samples' real
lengths (half of the L x L score and value products), never (sum L)^2 and never padding. A
training step does a forward and a backward of twice its FLOPs; recomputation is extra work the
hardware does, not useful model FLOPs, and is left out. Pure numpy: no torch, no Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_omnibal.models.spec import ModelSpec

TRAINING_PASSES = 3  # forward + backward (gradients of inputs and of weights)


@dataclass(frozen=True, kw_only=True)
class ModelFlops:
    """Forward FLOPs per unit: per image tile (patch embedding, each ViT layer, projector), per
    LLM token (each LLM layer's projections and MLP, the output head) and per squared sample
    length (each LLM layer's causal attention)."""

    patch_per_tile: float
    vit_layer_per_tile: float
    projector_per_tile: float
    llm_layer_per_token: float
    llm_layer_per_sumsq: float
    head_per_token: float
    vit_layers: int
    llm_layers: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"ModelFlops.{name} must be >= 0, got {value}")

    @classmethod
    def of(cls, spec: ModelSpec) -> ModelFlops:
        v, llm = spec.vit, spec.llm
        s, hv = v.seq_per_tile, v.hidden_size
        h, q = llm.hidden_size, llm.q_size  # q: heads x head size (Qwen3-32B: 8192 on 5120)
        mlp = (3 if llm.gated_mlp else 2) * h * llm.ffn_hidden_size
        return cls(
            patch_per_tile=2.0 * v.num_patches * 3 * v.patch_size**2 * hv,
            vit_layer_per_tile=2.0 * s * (4 * hv * hv + 2 * hv * v.ffn_hidden_size)
            + 4.0 * s * s * hv,
            projector_per_tile=2.0 * spec.tokens_per_tile
            * (spec.projector_in * spec.projector_hidden + spec.projector_hidden * h),
            llm_layer_per_token=2.0 * (2 * h * q + 2 * h * llm.kv_size + mlp),
            llm_layer_per_sumsq=2.0 * q,
            head_per_token=2.0 * h * llm.vocab_size,
            vit_layers=v.num_layers,
            llm_layers=llm.num_layers,
        )  # fmt: skip

    def forward(self, tiles: np.ndarray, tokens: np.ndarray, sumsq: np.ndarray) -> np.ndarray:
        """Forward FLOPs of the whole model over work of `tiles` image tiles, `tokens` LLM
        tokens and `sumsq` = sum of the packed samples' squared lengths (arrays broadcast)."""
        tiles, tokens, sumsq = (np.asarray(x, np.float64) for x in (tiles, tokens, sumsq))
        per_tile = (self.patch_per_tile + self.vit_layers * self.vit_layer_per_tile
                    + self.projector_per_tile)  # fmt: skip
        per_token = self.llm_layers * self.llm_layer_per_token + self.head_per_token
        return tiles * per_tile + tokens * per_token + sumsq * self.llm_layers * (
            self.llm_layer_per_sumsq
        )

    def training(self, tiles: np.ndarray, tokens: np.ndarray, sumsq: np.ndarray) -> np.ndarray:
        """Useful FLOPs of a training step over that work: forward and backward, no recompute."""
        return TRAINING_PASSES * self.forward(tiles, tokens, sumsq)
