"""DeepStack features in flight across pipeline stages (Qwen3-VL).

The hidden states after each tapped ViT layer d_i travel from the tap to the projector, whose
stage runs the DeepStack mergers; merged feature i then travels on to the stage of LLM layer i,
which adds it to the visual positions after that layer. A stage boundary that lies between a
feature's producer and its consumer carries it beside the hidden state: the transfer grows by
its bytes, and the receiving stage holds the received tensor until that micro-batch's backward
(Megatron keeps a stage's received inputs per micro-batch in flight), so its activation memory
grows by it times its in-flight micro-batches. Units are [ViT layers, projector, LLM layers].
"""

from __future__ import annotations

import numpy as np

from megatron_omnibal.models.spec import ModelSpec

MIB = 2.0**20
BF16 = 2


def deepstack_inbound(model: ModelSpec, tp: int) -> np.ndarray | None:
    """(U, 4) MiB per micro-batch feature (tiles, tokens, sum of squares, 1) that the boundary
    before each unit carries beside the hidden state (row 0 unused); None without DeepStack.

    A tap's hidden states (every patch of a tile, the ViT's width) cross the boundaries after
    its layer up to the projector; merged feature i (the tile's LLM tokens, the LLM's width)
    crosses those after the projector up to LLM layer i. A tap is replicated over the TP ranks,
    as the ViT's hidden state is (the tower runs no sequence parallelism); a merged feature is
    split over them, as the LLM's hidden state is under sequence parallelism (each rank's share
    of the image tokens)."""
    v = model.vit
    if not v.deepstack_indexes:
        return None
    nv = v.num_layers
    units = nv + 1 + model.llm.num_layers
    tap = v.seq_per_tile * v.hidden_size * BF16 / MIB
    merged = model.tokens_per_tile * model.llm.hidden_size * BF16 / tp / MIB
    tiles = np.zeros(units)
    for i, layer in enumerate(v.deepstack_indexes):
        tiles[layer + 1 : nv + 1] += tap  # boundaries after the tap, up to the projector
        tiles[nv + 1 : nv + 2 + i] += merged  # after the projector, up to LLM layer i
    out = np.zeros((units, 4))
    out[:, 0] = tiles
    out[0] = 0.0
    return out
