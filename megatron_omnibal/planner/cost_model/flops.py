"""Model FLOPs of a VLM's parts per unit of work: one formula for the planner's analytic costs
and the training log's model TFLOP/s and MFU.

Matrix multiplies only, 2 FLOPs per multiply-add. Every tile's patches attend to each other;
LLM attention is causal within each packed sample, so it costs sum(L^2) over the samples' real
lengths (half of the L x L score and value products), never (sum L)^2 and never padding. A
training step does a forward and a backward of twice its FLOPs; recomputation is extra work the
hardware does, not useful model FLOPs, and is left out. Pure numpy: no torch, no Megatron.

A native-resolution ViT (Qwen2.5-VL) is priced per merge group ("tile", 4 patches): its patches
attend within their window (8 x 8 patches; smaller at an image's right and bottom edges) in the
windowed layers and to every patch of their image in the `fullatt_block_indexes` layers, so a
layer's attention depends on the sizes of the images. `vit_layer_flops` counts one layer
exactly from the images' patch grids; the per-tile rates below use the data's images through
the model family's `vit_attention` (models/families: how many patches a patch attends to,
averaged over patches); a tower without windows (Qwen3-VL) attends over each whole image in
every layer.

A mixture-of-experts LLM layer counts the experts a token is routed to (top-k) and its router,
not every expert; DeepStack mergers (Qwen3-VL) cost what the merger costs, each, per tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_omnibal.models.families.registry import family_of_spec
from megatron_omnibal.models.spec import ModelSpec, VisionSpec

TRAINING_PASSES = 3  # forward + backward (gradients of inputs and of weights)


def vit_layer_linear_per_patch(v: VisionSpec) -> float:
    """Forward FLOPs per patch (or token) of a ViT layer's projections and MLP."""
    hv = v.hidden_size
    return 2.0 * (4 * hv * hv + (3 if v.gated_mlp else 2) * hv * v.ffn_hidden_size)


def vit_layer_flops(v: VisionSpec, grids: np.ndarray, full: bool) -> float:
    """Exact forward FLOPs of one native-resolution ViT layer over images of patch grids
    (t, h, w) (rows of `grids`): projections and MLP for every patch, attention within each
    temporal slice of an image (`full`) or within each window of `v.window_patches` per side
    (windowed; the grid is cut from its top-left corner, so the last row and column of windows
    may be smaller, as transformers' window index cuts it)."""
    grids = np.asarray(grids, np.int64).reshape(-1, 3)
    t, h, w = grids.T
    if full or not v.windowed:
        pairs = t * (h * w) ** 2
    else:  # a window of r x c patches holds (r c)^2 pairs: the sum factors over rows, columns
        k = v.window_patches
        pairs = t * ((h // k) * k * k + (h % k) ** 2) * ((w // k) * k * k + (w % k) ** 2)
    patches = int((t * h * w).sum())
    return patches * vit_layer_linear_per_patch(v) + 4.0 * v.hidden_size * float(pairs.sum())


def llm_mlp_params_per_token(spec: ModelSpec) -> int:
    """Weights one token multiplies in an LLM layer's MLP: the dense MLP, or a mixture of
    experts' router and the `moe_top_k` experts it picks (the active experts, not all)."""
    llm = spec.llm
    if llm.is_moe:
        return llm.hidden_size * llm.num_experts + llm.moe_top_k * llm.expert_params
    return (3 if llm.gated_mlp else 2) * llm.hidden_size * llm.ffn_hidden_size


@dataclass(frozen=True, kw_only=True)
class ModelFlops:
    """Forward FLOPs per unit: per image tile (patch embedding, each ViT layer, projector), per
    LLM token (each LLM layer's projections and MLP, the output head) and per squared sample
    length (each LLM layer's causal attention). A native-resolution ViT's
    `vit_full_layers` full-attention layers cost `vit_full_layer_per_tile` each, its other
    (windowed) layers `vit_layer_per_tile`."""

    patch_per_tile: float
    vit_layer_per_tile: float
    projector_per_tile: float
    llm_layer_per_token: float
    llm_layer_per_sumsq: float
    head_per_token: float
    vit_layers: int
    llm_layers: int
    vit_full_layer_per_tile: float = 0.0
    vit_full_layers: int = 0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"ModelFlops.{name} must be >= 0, got {value}")
        if self.vit_full_layers > self.vit_layers:
            raise ValueError(f"ModelFlops.vit_full_layers {self.vit_full_layers} exceeds the "
                             f"{self.vit_layers} ViT layers")

    def vit_layer(self, index: int, full_indexes: tuple[int, ...]) -> float:
        """Forward FLOPs per tile of ViT layer `index` (a full-attention one if listed)."""
        return self.vit_full_layer_per_tile if index in full_indexes else self.vit_layer_per_tile

    @classmethod
    def of(cls, spec: ModelSpec, image_tiles: np.ndarray | None = None) -> ModelFlops:
        """The rates of `spec`; `image_tiles` (tiles of each image of the data) prices a
        native-resolution ViT's attention (tiled ViTs attend within a tile and ignore it)."""
        v, llm = spec.vit, spec.llm
        s, hv = v.seq_per_tile, v.hidden_size
        h, q = llm.hidden_size, llm.q_size  # q: heads x head size (Qwen3-32B: 8192 on 5120)
        mlp = llm_mlp_params_per_token(spec)
        mergers = 1 + len(v.deepstack_indexes)  # the merger and each DeepStack merger
        attention = family_of_spec(spec).vit_attention(v, image_tiles)
        window, full = attention.window_span, attention.full_span
        return cls(
            patch_per_tile=2.0 * v.num_patches * v.patch_dim * hv,
            vit_layer_per_tile=s * vit_layer_linear_per_patch(v) + 4.0 * s * window * hv,
            vit_full_layer_per_tile=s * vit_layer_linear_per_patch(v) + 4.0 * s * full * hv,
            vit_full_layers=attention.full_layers,
            projector_per_tile=2.0 * mergers * spec.tokens_per_tile
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
        windowed = self.vit_layers - self.vit_full_layers
        per_tile = (self.patch_per_tile + windowed * self.vit_layer_per_tile
                    + self.vit_full_layers * self.vit_full_layer_per_tile
                    + self.projector_per_tile)  # fmt: skip
        per_token = self.llm_layers * self.llm_layer_per_token + self.head_per_token
        return tiles * per_tile + tokens * per_token + sumsq * self.llm_layers * (
            self.llm_layer_per_sumsq
        )

    def training(self, tiles: np.ndarray, tokens: np.ndarray, sumsq: np.ndarray) -> np.ndarray:
        """Useful FLOPs of a training step over that work: forward and backward, no recompute."""
        return TRAINING_PASSES * self.forward(tiles, tokens, sumsq)
