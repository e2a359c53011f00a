"""The transformer blocks of both towers as megatron-core builds them: its GPT layer spec, with
the parts InternViT needs swapped in, and norms that work under sequence parallelism; a
mixture-of-experts LLM gets megatron-core's MoE layer in every layer's MLP.

Why not megatron-core's own options: InternViT scales each residual branch by a learned vector
(layer scale), normalises q and k over ALL heads at once (megatron-core's qk_layernorm is per
head, a different function), and has projection/MLP biases but no qkv bias, which
`add_bias_linear` cannot express. Each is a small submodule swapped into the spec, so the layer
keeps megatron-core's attention, recompute, tensor parallelism and checkpoint sharding. Without
Transformer Engine or Apex, megatron-core's torch norm refuses sequence parallelism (it does
not mark its parameters for the TP gradient all-reduce); TorchNorm does. Qwen3's per-head
QK-norm (megatron-core's qk_layernorm) has no local module in megatron-core: HeadRMSNorm is one,
for both backends. A native-resolution tower (Qwen2.5-VL) attends within windows in most layers
and over the whole image in a few: its layers use native_vision.WindowedAttention, megatron-core's
local attention picking its mask by layer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

try:  # Transformer Engine is an optional accelerator.
    import transformer_engine  # noqa: F401
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    HAVE_TE = True
except ImportError:
    HAVE_TE = False

LAYER_SCALE_INIT = 0.1  # InternViT's initial layer-scale value


class LayerScaleBiasDropoutAdd(torch.nn.Module):
    """`residual + dropout(scale * (x + bias))`: megatron-core's bias-dropout-add with
    InternViT's per-channel layer scale (HF `lambda_1`/`lambda_2`, OpenGVLab `ls1`/`ls2`)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), LAYER_SCALE_INIT))

    def forward(self, training: bool, fused: bool) -> Callable[..., torch.Tensor]:
        del fused  # one unfused implementation

        def bias_dropout_add(
            x_with_bias: tuple[torch.Tensor, torch.Tensor | None], residual: torch.Tensor, p: float
        ) -> torch.Tensor:
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            return residual + F.dropout(self.weight * x, p=p, training=training)

        return bias_dropout_add


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group; the backward sums too (every rank's output depends on it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class CrossHeadRMSNorm(MegatronModule):
    """RMSNorm of the whole q (or k) vector across all heads (InternViT-6B's QK-norm).

    Under tensor parallelism each rank holds some heads: the sum of squares is all-reduced over
    the TP group. Padded dummy heads carry zeros and are left out of the mean (`real_heads`).
    Called by megatron-core's SelfAttention with [s, b, local heads, head dim].
    """

    def __init__(
        self,
        hidden_size: int,
        config: TransformerConfig,
        eps: float = 1e-6,
        *,
        real_heads: int,
        norm_eps: float,
    ) -> None:
        del hidden_size, eps  # megatron-core passes the per-head size and the layers' epsilon
        super().__init__(config=config)
        tp = config.tensor_model_parallel_size
        local = config.num_attention_heads // tp
        self.weight = torch.nn.Parameter(torch.ones(local * config.kv_channels))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
        real_local = max(0, min(local, real_heads - rank * local))
        with torch.no_grad():
            self.weight[real_local * config.kv_channels :] = 0.0  # dummy heads stay zero
        self.real_width = real_heads * config.kv_channels
        self.eps = norm_eps
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, heads, dim = x.shape
        flat = x.float().reshape(s, b, heads * dim)
        sumsq = flat.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            sumsq = _AllReduceSum.apply(sumsq, parallel_state.get_tensor_model_parallel_group())
        normed = flat * torch.rsqrt(sumsq / self.real_width + self.eps)
        return (self.weight * normed.to(x.dtype)).view(s, b, heads, dim)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)


class HeadRMSNorm(torch.nn.Module):
    """RMSNorm of each q (or k) head with one weight shared by all heads (Qwen3's q_norm and
    k_norm), called by megatron-core's SelfAttention with [s, b, local heads, head dim].

    Under tensor parallelism each rank holds some of the heads, so its weight gradient covers
    only those: the weight enters through copy_to_tensor_model_parallel_region, whose backward
    sums the gradient over the TP group. (megatron-core's finalize_model_grads sums q/k_layernorm
    gradients by parameter name instead, when the model-wide config says qk_layernorm: that sum
    would also hit the ViT's TP-split cross-head norm, so the stage's own config leaves it off.)
    """

    def __init__(self, hidden_size: int, config: TransformerConfig, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.tp = config.tensor_model_parallel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.tp > 1:
            weight = tensor_parallel.copy_to_tensor_model_parallel_region(weight)
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * weight


def without_bias(cls: type) -> type:
    """`cls` (a megatron-core linear layer) that ignores the `bias=` it is built with: the qkv
    projection of InternViT-6B has no bias while its other linear layers do."""

    class NoBias(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["bias"] = False
            super().__init__(*args, **kwargs)

    NoBias.__name__ = NoBias.__qualname__ = f"{cls.__name__}NoBias"
    return NoBias


class TorchNorm:
    """torch LayerNorm / RMSNorm as megatron-core's local spec builds them, with its parameters
    marked `sequence_parallel` under sequence parallelism: each TP rank then normalises its own
    part of the sequence and finalize_model_grads sums their gradients over TP."""

    def __new__(
        cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any
    ) -> torch.nn.Module:
        kind = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = kind(hidden_size, eps=eps)
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm


def _base_spec(config: TransformerConfig, use_te: bool) -> ModuleSpec:
    """megatron-core's GPT layer; with experts in the config its MoE layer (router, alltoall
    dispatcher, SequentialMLP experts: configs.moe_fields) in place of the MLP."""
    moe = {"num_experts": config.num_moe_experts, "moe_grouped_gemm": config.moe_grouped_gemm}
    if use_te:
        return get_gpt_layer_with_transformer_engine_spec(normalization=config.normalization, **moe)
    return get_gpt_layer_local_spec(normalization=config.normalization, **moe)


def layer_spec(
    config: TransformerConfig,
    use_te: bool,
    mask_type: AttnMaskType,
    *,
    qkv_bias: bool = True,
    layer_scale: bool = False,
    qk_norm: bool = False,
    real_heads: int = 0,
    qk_norm_eps: float = 1e-6,
    head_qk_norm: bool = False,
    full_attention_layers: tuple[int, ...] | None = None,
) -> ModuleSpec:
    """A transformer layer spec: megatron-core's GPT layer (TE when `use_te`, else local torch
    modules) with this tower's attention mask, and optionally InternViT's layer scale,
    cross-head QK-norm and a qkv projection without bias, or Qwen3's per-head QK-norm; with
    `full_attention_layers` (local modules only), windowed attention except in those layers."""
    spec = copy.deepcopy(_base_spec(config, use_te))
    sub = spec.submodules
    if not use_te:
        sub.input_layernorm = sub.pre_mlp_layernorm = TorchNorm
    attn = sub.self_attention
    attn.params = {**attn.params, "attn_mask_type": mask_type}
    if not qkv_bias and (config.add_bias_linear or config.add_qkv_bias):
        attn.submodules.linear_qkv = without_bias(attn.submodules.linear_qkv)
    if qk_norm:
        norm = partial(CrossHeadRMSNorm, real_heads=real_heads, norm_eps=qk_norm_eps)
        attn.submodules.q_layernorm = norm
        attn.submodules.k_layernorm = norm
    if head_qk_norm:
        attn.submodules.q_layernorm = attn.submodules.k_layernorm = HeadRMSNorm
    if full_attention_layers is not None:
        from megatron_omnibal.megatron.stages.native_vision import WindowedAttention

        if use_te:
            raise ValueError("windowed attention is built with local (torch) modules only")
        attn.submodules.core_attention = partial(
            WindowedAttention, full_layers=tuple(full_attention_layers)
        )
    if layer_scale:
        sub.self_attn_bda = ModuleSpec(
            module=LayerScaleBiasDropoutAdd, params={"hidden_size": config.hidden_size}
        )
        sub.mlp_bda = ModuleSpec(
            module=LayerScaleBiasDropoutAdd, params={"hidden_size": config.hidden_size}
        )
    return spec


def block_spec(
    config: TransformerConfig, num_layers: int, use_te: bool, mask_type: AttnMaskType, **layer: Any
) -> TransformerBlockSubmodules | ModuleSpec:
    """The block of one stage's `num_layers` layers of this tower (see layer_spec for `layer`);
    with local modules its final norm is a TorchNorm too."""
    spec = layer_spec(config, use_te, mask_type, **layer)
    if use_te:
        return spec
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=TorchNorm)


_LOCAL_EXPERT = ".mlp.experts.local_experts."


def global_expert_name(name: str, config: TransformerConfig) -> str:
    """`name` with a local expert's index (SequentialMLP's `local_experts.{j}`) made global:
    expert-parallel rank r holds experts r x E/EP ... (r + 1) x E/EP - 1, as megatron-core
    numbers them in its checkpoints."""
    if _LOCAL_EXPERT not in name:
        return name
    head, tail = name.split(_LOCAL_EXPERT, 1)
    local, rest = tail.split(".", 1)
    per_rank = config.num_moe_experts // config.expert_model_parallel_size
    first = parallel_state.get_expert_model_parallel_rank() * per_rank if (
        config.expert_model_parallel_size > 1) else 0  # fmt: skip
    return f"{head}{_LOCAL_EXPERT}{first + int(local)}.{rest}"
