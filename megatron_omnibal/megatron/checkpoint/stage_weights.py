"""Which canonical (model-wide, whole) tensors a pipeline stage holds, under which local names.

Why: a Megatron checkpoint stores each (TP, PP, EP) rank's own state dict with LOCAL layer
indices (and a mixture-of-experts layer's experts by their index on their expert-parallel rank),
while conversion and comparison work on canonical tensors with GLOBAL layer indices. This module
is the one place that maps between the two for a layout, with pure arithmetic (no model built),
so the converter can stream a stage at a time and tests can check it against real modules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

import torch

from megatron_omnibal.megatron.checkpoint.tp_shard import shard
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout

_LAYER = re.compile(r"^(vit|llm)\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")
TIED_HEAD = "output_layer.weight"
EMBEDDING = "embedding.word_embeddings.weight"
# megatron-core linear layers that put an `_extra_state` entry into their state dict.
_LINEARS = re.compile(r"(linear_qkv|linear_proj|linear_fc1|linear_fc2|output_layer)\.weight$")


def owns(name: str, layout: StageLayout) -> bool:
    """Whether the stage holds canonical tensor `name` (a tied head's copy included)."""
    m = _LAYER.match(name)
    if m:
        first, end = getattr(layout, f"{m.group(1)}_layers")
        return first <= int(m.group(2)) < end
    if name.startswith("patch_embed."):
        return layout.patch_embed
    if name.startswith(("vit_final_norm.", "projector.", "deepstack_mergers.")):
        return layout.projector
    if name.startswith("embedding."):
        return layout.llm_embed
    if name.startswith(("llm.final_layernorm.", "output_layer.")):
        return layout.head
    raise ValueError(f"'{name}' is not a tensor of the VLM stage module")


def _shift_layer(name: str, layout: StageLayout, sign: int) -> str:
    """A layer tensor's index moved by `sign` times the stage's first layer of its tower."""
    m = _LAYER.match(name)
    if not m:
        return name
    first = getattr(layout, f"{m.group(1)}_layers")[0]
    return f"{m.group(1)}.layers.{int(m.group(2)) + sign * first}.{m.group(3)}"


def to_local(name: str, layout: StageLayout) -> str:
    """Global layer index -> the stage's own (0-based) index."""
    return _shift_layer(name, layout, -1)


def to_global(name: str, layout: StageLayout) -> str:
    """The stage's own layer index -> the global one (inverse of to_local)."""
    return _shift_layer(name, layout, 1)


def stage_names(spec: ModelSpec, layout: StageLayout, canonical: Iterable[str]) -> list[str]:
    """The canonical tensors of this stage's parameters, in `canonical`'s order. A tied head on
    another stage than the embedding holds its own copy of the embedding (`output_layer.weight`)."""
    names = [n for n in canonical if owns(n, layout)]
    if spec.llm.tie_embeddings and layout.head and not layout.llm_embed:
        names.append(TIED_HEAD)
    return names


def source(name: str, spec: ModelSpec) -> str:
    """The canonical tensor a stage parameter is made from (a tied head copies the embedding)."""
    return EMBEDDING if name == TIED_HEAD and spec.llm.tie_embeddings else name


def expert_index(name: str) -> int | None:
    """The expert index in a MoE layer's expert tensor's name (None: not an expert's)."""
    m = _EXPERT.match(name)
    return int(m.group(2)) if m else None


def renumber_expert(name: str, shift: int) -> str:
    """An expert tensor's name with its expert index moved by `shift` (global <-> the local
    index of an expert-parallel rank, whose experts are rank x E/EP ... (rank + 1) x E/EP - 1)."""
    m = _EXPERT.match(name)
    return f"{m.group(1)}{int(m.group(2)) + shift}{m.group(3)}" if m else name


def ep_owns(name: str, spec: ModelSpec, ep: int, ep_rank: int) -> bool:
    """Whether expert-parallel rank `ep_rank` (of `ep`) holds canonical tensor `name` (every
    rank holds what is not an expert's)."""
    e = expert_index(name)
    return e is None or e // (spec.llm.num_experts // ep) == ep_rank


def stage_state_dict(
    spec: ModelSpec,
    layout: StageLayout,
    tensors: Mapping[str, torch.Tensor],
    tp: int,
    rank: int,
    ep: int = 1,
    ep_rank: int = 0,
) -> dict[str, torch.Tensor | None]:
    """TP rank `rank`'s and expert-parallel rank `ep_rank`'s state dict of the stage (local
    names: layers from the stage's first, experts from the EP rank's first), as megatron-core's
    modules save it: parameters, and an empty `_extra_state` for each linear layer. `tensors`
    maps every canonical name of the stage (stage_names) to its tensor."""
    out: dict[str, torch.Tensor | None] = {}
    first_expert = ep_rank * (spec.llm.num_experts // ep)
    for name in tensors:
        if not ep_owns(name, spec, ep, ep_rank):
            continue
        local = renumber_expert(to_local(name, layout), -first_expert)
        out[local] = shard(name, tensors[name], spec, tp, rank)
        m = _LINEARS.search(local)
        if m:
            out[local[: m.start() + len(m.group(1))] + "._extra_state"] = None
    return out


def load_into(
    model: torch.nn.Module, spec: ModelSpec, tensors: Mapping[str, torch.Tensor], tp: int,
    rank: int, skip: Callable[[str], bool] = lambda n: False,
) -> None:  # fmt: skip
    """Copy canonical tensors into a built stage (`model`: megatron.model.VLMStage) at TP rank
    `rank`; every parameter but those `skip` names must be given, with the shape the module
    has."""
    from megatron_omnibal.megatron.stages.model import global_named_parameters

    params = global_named_parameters(model)
    for name, param in params.items():
        if skip(name):
            continue
        src = source(name, spec)
        if src not in tensors:
            raise KeyError(f"no tensor for parameter {name} (canonical {src})")
        piece = shard(name, tensors[src], spec, tp, rank)
        if piece.shape != param.shape:
            raise ValueError(
                f"{name}: the checkpoint gives {tuple(piece.shape)} on TP rank {rank}, the "
                f"module has {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(piece)
