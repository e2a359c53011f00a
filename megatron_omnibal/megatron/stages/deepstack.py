"""DeepStack (Qwen3-VL) over pipeline stages: taps in the ViT, their mergers, their injection
into the first LLM layers, and how they travel between stages.

Why: the hidden states after the ViT layers `deepstack_indexes` each pass their own merger
(LayerNorm over a merge group's concatenated patches, then the projector's MLP) and are added
to the LLM hidden states at the image positions after LLM layers 0, 1, ...: the tap of the
i-th lowest ViT layer after LLM layer i, its merger the one of its place in the config's list
(transformers' `Qwen3VLVisionModel` and `_deepstack_process`). A tap is made on the stage of its
ViT layer and added on the stage of its LLM layer, any number of stages (or virtual stages)
later, so the features travel with the activations in the ONE tensor Megatron's p2p carries,
concatenated along dim 0 (its variable_seq_lengths shape exchange carries any length):

- ViT stages: [running hidden; tap; tap; ...], each [patches, 1, Cv], the taps made so far in
  ViT layer order;
- from the projector's stage on: [hidden; block; block; ...], each [S, 1, H] (S / TP under
  sequence parallelism, split as the hidden states are), a block holding the merged features at
  the image positions and zeros elsewhere, for the LLM layers not yet passed; each is dropped on
  the stage that adds it.
A receiving stage splits with what it knows from the micro-batch (patches, padded sequence
length) and the layout (how many taps lie before it). Inside an LLM block the features ride in
the layers' `context` argument, which megatron-core passes through self-attention-only layers
and saves for recompute, and DeepStackLayer adds its own block to its output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout


@dataclass(frozen=True)
class DeepStackCounts:
    """What one stage knows of the taps: how many arrive and leave with the ViT hidden states,
    which ViT layers tap here, how many LLM blocks arrive and leave."""

    vit_in: int
    vit_out: int
    vit_taps: tuple[int, ...]  # global ViT layer indexes tapped on this stage
    llm_in: int
    llm_out: int
    first_llm_layer: int  # global index of this stage's first LLM layer (or where it would be)

    @classmethod
    def of(cls, spec: ModelSpec, layout: StageLayout) -> DeepStackCounts:
        taps = sorted(spec.vit.deepstack_indexes)
        (v0, v1), (l0, l1) = layout.vit_layers, layout.llm_layers
        blocks = len(taps)
        return cls(
            vit_in=sum(t < v0 for t in taps),
            vit_out=sum(t < v1 for t in taps),
            vit_taps=tuple(t for t in taps if v0 <= t < v1),
            llm_in=max(0, blocks - l0),
            llm_out=max(0, blocks - l1),
            first_llm_layer=l0,
        )


def pack(hidden: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
    """The one tensor a stage sends: `hidden` and `extra` along dim 0 (`hidden` itself without
    extras)."""
    return torch.cat([hidden, *extra]) if extra else hidden


def unpack(
    received: torch.Tensor, rows: int, count: int, where: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(hidden, [count extras]) of a received tensor of 1 + count parts of `rows` rows each."""
    if received.shape[0] != (1 + count) * rows:
        raise ValueError(
            f"{where}: received {received.shape[0]} rows, expected {1 + count} x {rows} "
            "(hidden states and DeepStack features): the stages disagree on the layout"
        )
    if count == 0:
        return received, []
    parts = [received.narrow(0, i * rows, rows) for i in range(1 + count)]  # rows may be 0
    return parts[0], parts[1:]


class DeepStackMerger(MegatronModule):
    """A tap's merger: [patches, 1, Cv] (merge groups consecutive) -> [units, H] in image
    order (`unit_restore`). LayerNorm over each group's concatenated patches, then an MLP
    shaped as the projector's (column/row parallel under TP)."""

    def __init__(self, config: TransformerConfig, spec: ModelSpec) -> None:
        super().__init__(config=config)
        self.width = spec.projector_in
        self.norm = torch.nn.LayerNorm(self.width, eps=spec.projector.norm_eps)
        self.mlp = MLP(
            config=config,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            input_size=self.width,
        )

    def forward(self, tap: torch.Tensor, unit_restore: torch.Tensor) -> torch.Tensor:
        out, bias = self.mlp(self.norm(tap.reshape(-1, 1, self.width)))
        if bias is not None:
            out = out + bias
        return out[:, 0].index_select(0, unit_restore)


class DeepStackMergers(torch.nn.ModuleDict):
    """The mergers of all taps, keyed by their place in the config's `deepstack_indexes`
    (checkpoint names `deepstack_mergers.<k>.*` whatever the stage)."""

    def __init__(self, config: TransformerConfig, spec: ModelSpec) -> None:
        super().__init__({str(k): DeepStackMerger(config, spec) for k in range(
            len(spec.vit.deepstack_indexes))})  # fmt: skip
        indexes = list(spec.vit.deepstack_indexes)
        self.order = [str(indexes.index(t)) for t in sorted(indexes)]

    def forward(self, taps: list[torch.Tensor], unit_restore: torch.Tensor) -> list[torch.Tensor]:
        """Merged features of the taps (given in ViT layer order), in that order."""
        return [self[k](tap, unit_restore) for k, tap in zip(self.order, taps, strict=True)]

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """Each merger's own (its MLP split over TP): megatron-core would take a plain
        ModuleDict's tensors as replicated."""
        out: dict = {}
        for k, merger in self.items():
            out.update(merger.sharded_state_dict(f"{prefix}{k}.", sharded_offsets, metadata))
        return out


class DeepStackLayer(TransformerLayer):
    """megatron-core's TransformerLayer that adds block `deepstack_slot` of its `context`
    ([blocks, S, 1, H]) to its output (None: a layer after the last tap's)."""

    deepstack_slot: int | None = None

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        output, context = super().forward(*args, **kwargs)
        if context is not None and self.deepstack_slot is not None:
            output = output + context[self.deepstack_slot]
        return output, context


def with_deepstack_layers(
    spec: TransformerBlockSubmodules | ModuleSpec,
) -> TransformerBlockSubmodules | ModuleSpec:
    """A block spec (layer_specs.block_spec's) whose layers are DeepStackLayers."""

    def layer(s: ModuleSpec) -> ModuleSpec:
        return dataclasses.replace(s, module=DeepStackLayer)

    if isinstance(spec, TransformerBlockSubmodules):
        return TransformerBlockSubmodules(
            layer_specs=[layer(s) for s in spec.layer_specs], layer_norm=spec.layer_norm
        )
    return layer(spec)


def set_slots(layers: torch.nn.ModuleList, counts: DeepStackCounts) -> None:
    """Each layer's block in the context this stage gives its LLM block (the blocks of LLM
    layers first_llm_layer, first_llm_layer + 1, ...)."""
    for layer in layers:
        slot = layer.layer_number - 1 - counts.first_llm_layer
        layer.deepstack_slot = slot if slot < counts.llm_in else None


def dense_block(is_image: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """[S, 1, H] zeros with `features` [image tokens, H] at the image positions ([S, 1, 1])."""
    zeros = features.new_zeros(is_image.shape[0], 1, features.shape[-1])
    return zeros.masked_scatter(is_image, features)
