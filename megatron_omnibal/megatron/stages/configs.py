"""megatron-core TransformerConfigs of one pipeline stage, one per tower, from the model spec.

Why per tower: the ViT, the projector MLP and the LLM differ in width, norm, epsilon, biases and
activation, and each tower carries its own pipeline layout (so megatron-core numbers its layers
globally) and this stage's recompute count. Pure configuration: nothing is built here.

Tensor parallelism: the LLM's heads must split evenly (an error lists the sizes that work); the
ViT's heads are padded up to a multiple of TP with dummy heads whose weights are zero (InternViT-6B
has 25 heads), as Megatron-LM does for InternViT. Sequence parallelism applies to the LLM only:
the ViT's batch is tiles of a fixed patch count and the projector sees image tokens, neither a
sequence that TP splits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omnibal.megatron.stages.layout import megatron_layout
from megatron_omnibal.models.spec import LanguageSpec, ModelSpec, VisionSpec, check_expert_parallel
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "quick_gelu": quick_gelu,
    "silu": F.silu,
    "relu": F.relu,
}
NORMS = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}


@dataclass
class StageConfigs:
    """TransformerConfigs of one stage: ViT layers, projector MLP, LLM (embedding/layers/head)."""

    vit: TransformerConfig
    projector: TransformerConfig
    llm: TransformerConfig
    padded_vocab_size: int
    vit_real_heads: int  # the ViT's heads before padding for TP


def padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Vocab rounded up to a multiple of divisible_by * tp, as Megatron pads it."""
    m = divisible_by * tp
    return int(math.ceil(vocab_size / m) * m)


def padded_heads(heads: int, tp: int) -> int:
    """Heads rounded up to a multiple of TP (the extra ones are zero dummy heads)."""
    return -(-heads // tp) * tp


def llm_tp_sizes(spec: ModelSpec, limit: int = 64) -> list[int]:
    """TP sizes that split the LLM's heads and KV groups (a group may span several ranks)."""
    heads, groups = spec.llm.num_attention_heads, spec.llm.num_query_groups
    return [
        t for t in range(1, limit + 1) if heads % t == 0 and (groups % t == 0 or t % groups == 0)
    ]


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """Raise ValueError naming the TP sizes that work unless `tp` splits the LLM's heads."""
    if tp < 1 or tp not in llm_tp_sizes(spec, max(tp, 1)):
        raise ValueError(
            f"tensor parallel size {tp} does not split the LLM's {spec.llm.num_attention_heads} "
            f"attention heads and {spec.llm.num_query_groups} KV groups; sizes that work: "
            f"{', '.join(map(str, llm_tp_sizes(spec)))}"
        )


def _recompute(k: int) -> dict[str, Any]:
    if k == 0:
        return {
            "recompute_granularity": None,
            "recompute_method": None,
            "recompute_num_layers": None,
        }
    return {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": k}


def _tower_fields(tower: VisionSpec | LanguageSpec) -> dict[str, Any]:
    """The TransformerConfig fields both towers take from their spec alike."""
    return {
        "num_layers": tower.num_layers,
        "hidden_size": tower.hidden_size,
        "ffn_hidden_size": tower.ffn_hidden_size,
        "normalization": NORMS[tower.norm],
        "layernorm_epsilon": tower.norm_eps,
        "add_qkv_bias": tower.qkv_bias,
        "qk_layernorm": tower.qk_norm,
        "activation_func": ACTIVATIONS[tower.activation],
    }


def moe_fields(llm: LanguageSpec) -> dict[str, Any]:
    """The TransformerConfig fields of a mixture-of-experts LLM (none for a dense one).

    Qwen3-MoE's router: a softmax over all experts, the top k, renormalised when
    `moe_norm_topk_prob`. megatron-core's softmax over the top k logits alone is exactly the
    renormalised form; its pre-softmax mode (softmax over all, then top k) the other. The
    router runs in fp32 (its top-k choice must not flip with the precision), the experts are
    megatron-core's SequentialMLP (grouped GEMM needs kernels a CPU build lacks), and tokens
    travel by all-to-all between expert-parallel ranks. The load-balancing loss is
    megatron-core's per-layer switch loss, scaled by `moe_aux_loss_coeff` (0: none)."""
    if not llm.is_moe:
        return {}
    return {
        "num_moe_experts": llm.num_experts,
        "moe_router_topk": llm.moe_top_k,
        "moe_ffn_hidden_size": llm.moe_ffn_hidden_size,
        "moe_router_pre_softmax": not llm.moe_norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": float(llm.moe_aux_loss_coeff),
        "moe_router_dtype": "fp32",
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "alltoall",
    }


def stage_configs(
    spec: ModelSpec,
    layouts: list[StageLayout],
    stage: int,
    tp_size: int = 1,
    overrides: dict[str, Any] | None = None,
    vpp: int = 1,
    ep_size: int = 1,
) -> StageConfigs:
    """The TransformerConfigs (virtual) stage `stage` builds with. `layouts` come validated
    (every way of making them checks them: layout.layout_from_plan / _counts / _dicts); with
    `vpp` model chunks per rank they are the pp x vpp virtual stages.

    `overrides` are TransformerConfig fields from the training flags applied to every tower
    (dtype, dropout, init, sequence_parallel: the LLM's only). `ep_size` splits the LLM's
    experts over expert-parallel ranks (a mixture-of-experts LLM only).
    """
    check_tensor_parallel(spec, tp_size)
    check_expert_parallel(spec, ep_size)
    pp = len(layouts) // vpp
    st = layouts[stage]
    base: dict[str, Any] = {
        "tensor_model_parallel_size": tp_size,
        "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": vpp if vpp > 1 else None,
        "pipeline_dtype": torch.float32,
        "params_dtype": torch.float32,
        "variable_seq_lengths": True,
        # TransformerConfig rejects variable_seq_lengths with the default allgather dispatcher,
        # even without MoE.
        "moe_token_dispatcher_type": "alltoall",
        "calculate_per_token_loss": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        # As megatron.training does: free sent activations (stage outputs are never views).
        "deallocate_pipeline_outputs": True,
    }
    base.update(overrides or {})
    sequence_parallel = bool(base.pop("sequence_parallel", False)) and tp_size > 1
    layout = (
        (lambda t: {"pipeline_model_parallel_layout": megatron_layout(layouts, t)})
        if len(layouts) > 1
        else (lambda t: {})
    )
    v, p, llm = spec.vit, spec.projector, spec.llm
    vit_heads = padded_heads(v.num_attention_heads, tp_size)
    vit = TransformerConfig(
        **{
            **base,
            **_tower_fields(v),
            "sequence_parallel": False,
            "num_attention_heads": vit_heads,
            "num_query_groups": vit_heads,
            "kv_channels": v.head_dim,
            "add_bias_linear": True,
            "gated_linear_unit": v.gated_mlp,
            **_recompute(st.vit_recompute),
            **layout("vit"),
        }
    )
    projector = TransformerConfig(
        **{
            **base,
            "sequence_parallel": False,
            "num_layers": 1,
            "pipeline_model_parallel_size": 1,
            "virtual_pipeline_model_parallel_size": None,
            "hidden_size": llm.hidden_size,
            "ffn_hidden_size": p.hidden_size,
            "num_attention_heads": llm.num_attention_heads,
            "layernorm_epsilon": p.norm_eps,
            "add_bias_linear": p.bias,
            "gated_linear_unit": False,
            "activation_func": ACTIVATIONS[p.activation],
        }
    )
    language = TransformerConfig(
        **{
            **base,
            **_tower_fields(llm),
            "sequence_parallel": sequence_parallel,
            "num_attention_heads": llm.num_attention_heads,
            "num_query_groups": llm.num_query_groups,
            "kv_channels": llm.kv_channels,
            "add_bias_linear": False,
            "gated_linear_unit": llm.gated_mlp,
            **_recompute(st.llm_recompute),
            **layout("llm"),
            **moe_fields(llm),
            "expert_model_parallel_size": ep_size,
        }
    )
    return StageConfigs(
        vit, projector, language, padded_vocab(llm.vocab_size, tp_size), v.num_attention_heads
    )
