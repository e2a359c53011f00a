"""LoRA adapters on the stage's megatron-core linear layers, sharded as the base layer is.

Why beside the base layer, not a wrapper around it: the base keeps its module, its parameter
names (checkpoints, the HF converters, `global_name`) and megatron-core's own forward; the
adapter is two parameters of the base module (`lora_a`, `lora_b`) and a forward hook that adds
alpha / rank * B A dropout(x) to its output, so recompute, pipeline schedules and the optimizer
see ordinary parameters.

Tensor parallelism (x is the base layer's input, as megatron-core hands it over):
- column-parallel base (qkv, fc1): A whole, B split like the weight's rows. h = A x is the same
  on every TP rank; its gradient is summed over TP (copy_to_tensor_model_parallel_region), so A
  gets the whole gradient everywhere. Under sequence parallelism x is this rank's part of the
  sequence: h is computed there and gathered, and A's partial gradients are summed over TP by
  finalize_model_grads (`sequence_parallel`, as megatron-core's norms).
- row-parallel base (proj, fc2): A split like the weight's columns, B whole. h = sum over TP of
  A_r x_r (reduce_from_tensor_model_parallel_region; scattered over the sequence under sequence
  parallelism, where B's partial gradients are summed by finalize_model_grads).
Initial values come from the canonical (TP = 1) tensors seeded by the layer's model-wide name,
so a run starts from the same adapters at any layout: A as PEFT draws it (uniform within
1/sqrt(in)), B zero.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_omnibal.megatron.stages.finetune import PART_MODULES
from megatron_omnibal.megatron.stages.model import VLMStage, global_name
from megatron_omnibal.models.lora import LoraLayer, LoraSpec, lora_layers

LORA_PARAM = "omnibal_lora"  # attribute marking adapter parameters
VIEWS = ("all", "base", "trainable")  # what a LoRA stage's checkpoint state holds


def initial_adapter(layer: LoraLayer, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical (A, B) a run starts from: A uniform in +-1/sqrt(in) from a generator
    seeded by the layer's name and `seed` (PEFT's kaiming_uniform(a=sqrt(5))), B zero."""
    g = torch.Generator().manual_seed(zlib.crc32(layer.name.encode()) ^ seed)
    bound = layer.in_features**-0.5
    a = (torch.rand(rank, layer.in_features, generator=g) * 2 - 1) * bound
    return a, torch.zeros(layer.out_features, rank)


def apply_lora(stage: VLMStage, lora: LoraSpec, seed: int = 0) -> list[str]:
    """Give the stage's targeted linear layers adapters and freeze everything but the adapters
    and `lora.train`'s parts. Returns the adapted layers' model-wide names on this stage."""
    if stage.use_te:
        raise ValueError(
            "LoRA adapters are built on megatron-core's local linear layers: run with "
            "--transformer-impl local (Transformer Engine's fused norm + linear hides the "
            "adapter's input)"
        )
    layers = lora_layers(stage.spec, lora)
    adapted = []
    for local, module in stage.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        name = global_name(stage, f"{local}.weight")[: -len(".weight")]
        layer = layers.get(name)
        if layer is None:
            continue
        _attach(module, layer, lora, seed)
        adapted.append(name)
    trained = {m for part in lora.train for m in PART_MODULES[part]}
    for top, module in stage.named_children():
        for p in module.parameters():
            if not getattr(p, LORA_PARAM, False) and top not in trained:
                p.requires_grad_(False)
    for first in (stage.patch_embed, stage.embedding):
        if first is not None:
            first.register_forward_hook(_input_requires_grad)
    stage.lora_view = "all"
    for method in ("sharded_state_dict", "state_dict_for_save_checkpoint"):
        setattr(stage, method, partial(_viewed, stage, getattr(stage, method)))
    return adapted


def _viewed(stage: VLMStage, method: Any, *args: Any, **kwargs: Any) -> dict:
    """The stage's checkpoint state as its `lora_view` says: all of it; the base (no
    adapters: what --pretrained-checkpoint holds); or what trains (adapters and the parts
    trained in full: an adapter-only save)."""
    state = method(*args, **kwargs)
    view = stage.lora_view
    if view == "all":
        return state
    prefix = kwargs.get("prefix", args[0] if args else "")
    params = dict(stage.named_parameters())
    out = {}
    for key, value in state.items():
        param = params.get(key[len(prefix):]) if key.startswith(prefix) else None
        adapter = param is not None and getattr(param, LORA_PARAM, False)
        keep = (not adapter) if view == "base" else (param is not None and param.requires_grad)
        if keep:
            out[key] = value
    return out


@contextmanager
def checkpoint_view(chunks: Sequence[torch.nn.Module], view: str) -> Iterator[None]:
    """Within the block, the LoRA stages among `chunks` (wrapped or not) save and load the
    `view` of their state (VIEWS); stages without adapters are left alone."""
    if view not in VIEWS:
        raise ValueError(f"checkpoint view {view!r}: one of {', '.join(VIEWS)}")
    stages = []
    for chunk in chunks:
        while not isinstance(chunk, VLMStage) and hasattr(chunk, "module"):
            chunk = chunk.module
        if hasattr(chunk, "lora_view"):
            stages.append((chunk, chunk.lora_view))
            chunk.lora_view = view
    try:
        yield
    finally:
        for stage, before in stages:
            stage.lora_view = before


def _input_requires_grad(_module: torch.nn.Module, _args: tuple, output: Any) -> Any:
    """A frozen embedding's output made to require a gradient: otherwise a recomputed block
    (megatron-core's checkpoint passes gradients only to inputs that require one) would give
    its adapters none, and a stage of frozen layers could not pass gradients back."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)
    return output


def _attach(module: torch.nn.Module, layer: LoraLayer, lora: LoraSpec, seed: int) -> None:
    column = isinstance(module, ColumnParallelLinear)
    if column != layer.column:
        raise ValueError(f"{layer.name}: expected a {'column' if layer.column else 'row'}-"
                         "parallel linear layer")  # fmt: skip
    tp = module.tp_group.size() if module.tp_group is not None else 1
    tp_rank = module.tp_group.rank() if module.tp_group is not None else 0
    weight = module.weight
    full_a, _ = initial_adapter(layer, lora.rank, seed)
    if not column:  # A split like the weight's columns (padded ViT heads: zero columns)
        full_a = F.pad(full_a, (0, weight.shape[1] * tp - full_a.shape[1]))
        full_a = full_a.chunk(tp, dim=1)[tp_rank]
    local_b = torch.zeros(weight.shape[0], lora.rank)  # B starts at zero: no values to split
    sequence_parallel = bool(getattr(module, "sequence_parallel", False)) and tp > 1
    for suffix, piece in (("lora_a", full_a), ("lora_b", local_b)):
        param = torch.nn.Parameter(
            piece.contiguous().to(device=weight.device, dtype=weight.dtype)
        )
        split = (suffix == "lora_b") == column
        if split:
            set_tensor_model_parallel_attributes(param, True, 0 if column else 1, 1)
        elif sequence_parallel:  # partial gradients over the sequence, summed over TP
            param.sequence_parallel = True
        setattr(param, LORA_PARAM, True)
        module.register_parameter(suffix, param)
    gated = column and layer.name.endswith("linear_fc1") and module.config.gated_linear_unit
    module.register_forward_hook(partial(_adapter_forward, column, sequence_parallel, lora))
    module.sharded_state_dict = partial(_sharded_state_dict, module, column, gated)


def _adapter_forward(
    column: bool, sequence_parallel: bool, lora: LoraSpec, module: torch.nn.Module,
    args: tuple, output: tuple[torch.Tensor, Any],
) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """The base layer's (output, bias) with the adapter's term added to the output."""
    x = args[0]
    out, bias = output
    split_input = sequence_parallel or not column  # this rank holds a part of x
    if lora.dropout > 0 and module.training:
        if split_input:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                x = F.dropout(x, p=lora.dropout)
        else:
            x = F.dropout(x, p=lora.dropout)
    h = torch.matmul(x, module.lora_a.t())
    if column:
        if sequence_parallel:
            h = tensor_parallel.gather_from_sequence_parallel_region(h)
        else:
            h = tensor_parallel.copy_to_tensor_model_parallel_region(h)
    elif sequence_parallel:
        h = tensor_parallel.reduce_scatter_to_sequence_parallel_region(h)
    else:
        h = tensor_parallel.reduce_from_tensor_model_parallel_region(h)
    delta = torch.matmul(h, module.lora_b.t()) * lora.scale
    return out + delta.to(out.dtype), bias


def _sharded_state_dict(
    module: torch.nn.Module, column: bool, gated: bool, prefix: str = "",
    sharded_offsets: tuple = (), metadata: dict | None = None,
) -> dict:  # fmt: skip
    """The base layer's checkpoint shards with the adapters': B split along its rows beside a
    column-parallel weight (a gated fc1's [gate; up] as megatron-core's MLP splits its weight),
    A along its columns beside a row-parallel one; the other one replicated."""
    state = module.state_dict(prefix="", keep_vars=True)
    axes = {"weight": 0, "bias": 0, "lora_b": 0} if column else {"weight": 1, "lora_a": 1}
    metadata = metadata or {}
    out = make_sharded_tensors_for_checkpoint(
        state, prefix, axes, sharded_offsets, tp_group=module.tp_group,
        dp_cp_group=metadata.get("dp_cp_group"),
    )  # fmt: skip
    if gated:
        key = f"{prefix}lora_b"
        out[key] = apply_swiglu_sharded_factory(
            out[key], sharded_offsets, metadata.get("singleton_local_shards", False),
            tp_group=module.tp_group, dp_group=metadata.get("dp_cp_group"),
        )  # fmt: skip
    return out


def adapter_names(stage: torch.nn.Module) -> list[str]:
    """Model-wide names of the stage's adapter parameters."""
    return [global_name(stage, n) for n, p in stage.named_parameters()
            if getattr(p, LORA_PARAM, False)]  # fmt: skip
