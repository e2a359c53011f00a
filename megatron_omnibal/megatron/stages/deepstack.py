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
- from the projector's stage on: [hidden; block; block; ...], hidden [S, 1, H] (S / TP under
  sequence parallelism), each block [image tokens, 1, H]: one tap's merged features of the
  image tokens in this rank's part of the sequence (all of them without sequence parallelism),
  for the LLM layers not yet passed; each is dropped on the stage that adds it.
A receiving stage splits with what it knows from the micro-batch (patches, padded sequence
length, where the image tokens are: found on the host) and the layout (how many taps lie before
it). Inside a stage the blocks are laid at their image positions in [blocks, S, 1, H] (zeros
elsewhere) and ride in the LLM layers' `context` argument, which megatron-core passes through
self-attention-only layers and saves for recompute; DeepStackLayer adds its own block to its
output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
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


@dataclass(frozen=True)
class LocalImageRows:
    """This TP rank's part of the sequence (all of it without sequence parallelism): `first`,
    the image tokens before it (where its rows start in the merged features); `positions`, its
    image tokens' positions within it (host-side, int64)."""

    first: int
    positions: np.ndarray

    @property
    def count(self) -> int:
        return len(self.positions)


def local_image_rows(
    image_positions: np.ndarray, padded_len: int, parts: int, rank: int
) -> LocalImageRows:
    """The image rows of part `rank` of `parts` equal parts of a sequence of `padded_len`."""
    size = padded_len // parts
    lo, hi = rank * size, (rank + 1) * size
    first, last = np.searchsorted(image_positions, [lo, hi])
    return LocalImageRows(int(first), image_positions[first:last] - lo)


class _SliceOfReplicated(torch.autograd.Function):
    """Rows [first, first + count) of a tensor every TP rank computed alike; the backward sums
    the ranks' gradients (each covers its own rows only), so the replicated computation before
    it gets the whole gradient on every rank (as scatter_to_sequence_parallel_region's
    all-gather does for even parts)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, first: int, count: int, group: Any) -> torch.Tensor:
        ctx.first, ctx.rows, ctx.group = first, x.shape[0], group
        return x[first : first + count].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        whole = grad.new_zeros(ctx.rows, *grad.shape[1:])
        whole[ctx.first : ctx.first + grad.shape[0]] = grad
        torch.distributed.all_reduce(whole, group=ctx.group)
        return whole, None, None, None


def local_features(features: torch.Tensor, rows: LocalImageRows, group: Any) -> torch.Tensor:
    """This rank's rows [count, 1, H] of merged features [image tokens, H] (`group`: the TP
    group under sequence parallelism, else None)."""
    if group is None:
        return features[rows.first : rows.first + rows.count, None]
    return _SliceOfReplicated.apply(features, rows.first, rows.count, group)[:, None]


def lay_out(blocks: list[torch.Tensor], rows: LocalImageRows, length: int) -> torch.Tensor:
    """[blocks, length, 1, H]: each block's rows at its image positions, zeros elsewhere."""
    stacked = torch.stack(blocks)  # [blocks, image rows, 1, H]
    where = torch.from_numpy(rows.positions).to(stacked.device, non_blocking=True)
    zeros = stacked.new_zeros(len(blocks), length, *stacked.shape[2:])
    return zeros.index_copy(1, where, stacked)


def pack(hidden: torch.Tensor, extra: list[torch.Tensor]) -> torch.Tensor:
    """The one tensor a stage sends: `hidden` and `extra` along dim 0 (`hidden` itself without
    extras)."""
    return torch.cat([hidden, *extra]) if extra else hidden


def unpack(
    received: torch.Tensor, rows: int, count: int, extra_rows: int, where: str
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(hidden, [count extras]) of a received tensor of `rows` rows of hidden states and
    `count` extras of `extra_rows` rows each."""
    if received.shape[0] != rows + count * extra_rows:
        raise ValueError(
            f"{where}: received {received.shape[0]} rows, expected {rows} + {count} x "
            f"{extra_rows} (hidden states and DeepStack features): the stages disagree"
        )
    if count == 0:
        return received, []
    extras = [received.narrow(0, rows + i * extra_rows, extra_rows) for i in range(count)]
    return received.narrow(0, 0, rows), extras  # (extra_)rows may be 0


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
    ([blocks, S, 1, H], lay_out's) to its output (None: a layer after the last tap's)."""

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

