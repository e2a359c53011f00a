"""Megatron's mixture-of-experts flags of an --omnibal run, checked before any process group.

Why: the stages build the experts from the spec (stages/configs.moe_fields), while
megatron.training reads its own MoE flags to form the expert-parallel groups, log the
load-balancing loss and count FLOPs. So the spec's values go on the command line (the model's
flags, planner/plan_file/flags.py), a given value that disagrees is an error (run_args.SPLIT),
and a MoE option the stages do not build (dense layers among the MoE layers, shared experts,
capacity, grouped GEMM, ...) is refused by name instead of silently ignored. Nothing here
imports torch or Megatron.
"""

from __future__ import annotations

import argparse

from megatron_omnibal.megatron.flags.args import OmnibalArgsError
from megatron_omnibal.models.spec import ModelSpec, check_expert_parallel

# Flags whose value the spec (or the plan: EP) decides: a given one must agree (run_args.SPLIT).
MOE_SPLIT = frozenset({
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
    "moe_aux_loss_coeff", "expert_model_parallel_size",
})  # fmt: skip

# (flag, dest, the values the stages build): anything else is refused.
NOT_BUILT = (
    ("--moe-layer-freq", "moe_layer_freq", (1, [1])),
    ("--moe-grouped-gemm", "moe_grouped_gemm", (False,)),
    ("--moe-token-dispatcher-type", "moe_token_dispatcher_type", ("alltoall",)),
    ("--moe-router-load-balancing-type", "moe_router_load_balancing_type",
     ("aux_loss", ["aux_loss"])),
    ("--moe-router-score-function", "moe_router_score_function", ("softmax",)),
    ("--moe-expert-capacity-factor", "moe_expert_capacity_factor", (None,)),
    ("--moe-z-loss-coeff", "moe_z_loss_coeff", (None,)),
    ("--moe-shared-expert-intermediate-size", "moe_shared_expert_intermediate_size", (None,)),
    ("--moe-router-topk-scaling-factor", "moe_router_topk_scaling_factor", (None,)),
    ("--moe-input-jitter-eps", "moe_input_jitter_eps", (None,)),
    ("--moe-router-num-groups", "moe_router_num_groups", (None,)),
    ("--moe-router-enable-expert-bias", "moe_router_enable_expert_bias", (False,)),
)  # fmt: skip


def check_moe_args(args: argparse.Namespace, spec: ModelSpec, world: int) -> None:
    """Expert parallelism and Megatron's MoE options against the model, before any process
    group: raises OmnibalArgsError naming the flag."""
    ep = args.expert_model_parallel_size
    try:
        check_expert_parallel(spec, ep)
    except ValueError as exc:
        raise OmnibalArgsError(f"--expert-model-parallel-size {ep}: {exc}") from exc
    if not spec.llm.is_moe:
        return
    for flag, dest, built in NOT_BUILT:
        value = getattr(args, dest, None)
        if value not in built:
            raise OmnibalArgsError(
                f"{flag} {value}: not built with --omnibal (the LLM's {spec.llm.num_experts} "
                "experts are in every layer's MLP, routed by megatron-core's top-k router "
                "with its load-balancing loss, dispatched by all-to-all to SequentialMLP "
                "experts); drop the flag"
            )
    if getattr(args, "omnibal_lora_rank", None) is not None:
        raise OmnibalArgsError(
            f"--omnibal-lora-rank {args.omnibal_lora_rank}: LoRA adapters on a "
            "mixture-of-experts LLM are not built (its MLPs are experts); train in full"
        )
    tp = args.tensor_model_parallel_size
    etp = args.expert_tensor_parallel_size
    if etp not in (None, tp):
        raise OmnibalArgsError(
            f"--expert-tensor-parallel-size {etp}: the experts are split like the rest of the "
            f"LLM, over --tensor-model-parallel-size {tp}; drop the flag"
        )
    if tp > 1 and not args.sequence_parallel:
        raise OmnibalArgsError(
            f"--tensor-model-parallel-size {tp} with a mixture-of-experts LLM needs "
            "--sequence-parallel (megatron-core's MoE layer trains only with it under TP)"
        )
    per_stage = world // args.pipeline_model_parallel_size
    if per_stage % (ep * tp):
        raise OmnibalArgsError(
            f"--expert-model-parallel-size {ep}: the {per_stage} ranks of each pipeline stage "
            f"do not split into expert-parallel groups of {ep} x tensor-parallel {tp}"
        )
