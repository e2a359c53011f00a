"""Megatron-LM command-line flags: for a plan, and for the baseline configuration it beats.

The plan's flags are accepted by megatron.training 0.19's parser (tested); the per-stage layout
and recompute come from `--omnibal-plan`. The baseline's are what a Megatron-LM user would type
for the same run without OmniBal, so the speedup's reference can be re-run by hand.
"""

from __future__ import annotations

from megatron_omnibal.models.spec import ModelSpec


def model_flags(model: ModelSpec) -> list[str]:
    """The LLM's shape, as megatron.training spells it (its FLOPs figure reads these; RoPE base
    and Llama-3 scaling or M-RoPE sections, head size and QK-norm included: megatron.training's
    defaults differ)."""
    llm = model.llm
    flags = [
        "--num-layers", str(llm.num_layers),
        "--hidden-size", str(llm.hidden_size),
        "--ffn-hidden-size", str(llm.ffn_hidden_size),
        "--num-attention-heads", str(llm.num_attention_heads),
        "--vocab-size", str(llm.vocab_size),
    ]  # fmt: skip
    if llm.kv_channels * llm.num_attention_heads != llm.hidden_size:
        flags += ["--kv-channels", str(llm.kv_channels)]
    if llm.num_query_groups < llm.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(llm.num_query_groups)]
    if llm.qk_norm:
        flags += ["--qk-layernorm"]
    if llm.rope_scaling_factor:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", f"{llm.rope_scaling_factor:g}"]
    flags += ["--normalization", "RMSNorm" if llm.norm == "rmsnorm" else "LayerNorm"]
    flags += ["--norm-epsilon", str(llm.norm_eps)]
    if llm.gated_mlp:
        flags += ["--swiglu"]
    if llm.mrope_section:  # Qwen2.5-VL's multimodal RoPE
        flags += ["--position-embedding-type", "mrope",
                  "--mrope-section", *(str(x) for x in llm.mrope_section)]
    else:
        flags += ["--position-embedding-type", "rope"]
    if float(llm.rotary_base).is_integer():  # Megatron's flag takes an integer
        flags += ["--rotary-base", str(int(llm.rotary_base))]
    flags += ["--disable-bias-linear"]
    if llm.qkv_bias:
        flags += ["--add-qkv-bias"]
    if not llm.tie_embeddings:
        flags += ["--untie-embeddings-and-output-weights"]
    return flags + moe_flags(model)


def moe_flags(model: ModelSpec) -> list[str]:
    """A mixture-of-experts LLM's experts as megatron.training spells them: count, width, top-k
    (softmax over the top-k, which is the renormalised top-k of `moe_norm_topk_prob`; without
    it, the softmax over all experts first), the alltoall dispatcher and the auxiliary loss."""
    llm = model.llm
    if not llm.is_moe:
        return []
    flags = [
        "--num-experts", str(llm.num_experts),
        "--moe-ffn-hidden-size", str(llm.moe_ffn_hidden_size),
        "--moe-router-topk", str(llm.moe_top_k),
        "--moe-token-dispatcher-type", "alltoall",
    ]  # fmt: skip
    if not llm.moe_norm_topk_prob:
        flags.append("--moe-router-pre-softmax")
    if llm.moe_aux_loss_coeff:
        flags += ["--moe-router-load-balancing-type", "aux_loss",
                  "--moe-aux-loss-coeff", f"{llm.moe_aux_loss_coeff:g}"]  # fmt: skip
    return flags


def expert_flags(model: ModelSpec, ep: int) -> list[str]:
    """--expert-model-parallel-size of a mixture-of-experts LLM (none for a dense one)."""
    return ["--expert-model-parallel-size", str(ep)] if model.llm.is_moe else []


def run_flags(
    model: ModelSpec, tp: int, pp: int, dp: int, m: int, token_budget: int, ep: int = 1
) -> list[str]:
    """What a plan decides for a run, and the model's shape: parallel sizes, one packed
    micro-batch of up to `token_budget` tokens at a time, `m` per step and DP rank, bf16, and
    whole-layer recompute (its per-stage counts come from the plan itself)."""
    flags = [
        "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp),
        *expert_flags(model, ep),
        *model_flags(model),
        "--seq-length", str(token_budget),
        "--max-position-embeddings", str(token_budget),
        "--micro-batch-size", "1",
        "--global-batch-size", str(m * dp),
        "--bf16",
        "--recompute-granularity", "full",
        "--recompute-method", "block",
    ]  # fmt: skip
    if tp > 1:
        flags.append("--sequence-parallel")
    return flags


def plan_flags(
    model: ModelSpec, tp: int, pp: int, dp: int, m: int, token_budget: int, plan_path: str,
    ep: int = 1,
) -> list[str]:
    """Flags of a plan: its run flags, the optimizer it assumes, and the plan itself."""
    return [
        *run_flags(model, tp, pp, dp, m, token_budget, ep),
        "--use-distributed-optimizer",
        "--omnibal-plan", plan_path,
    ]  # fmt: skip


def baseline_flags(
    model: ModelSpec,
    tp: int,
    pp: int,
    micro_batch_size: int,
    global_batch: int,
    llm_layers: tuple[int, ...],
    recompute_vision: bool,
    recompute_num_layers: int,
    vpp: int = 1,
    ep: int = 1,
) -> list[str]:
    """Megatron-LM flags of a hand-chosen baseline (LLaVA layout: the vision encoder on the
    first stage). Uneven LLM splits use --decoder-first/last-pipeline-num-layers;
    `--recompute-vision` is Megatron-LM's examples/multimodal flag (every ViT layer); `vpp` > 1
    model chunks per rank select the interleaved schedule."""
    flags = [
        "--tensor-model-parallel-size", str(tp),
        "--pipeline-model-parallel-size", str(pp),
        *expert_flags(model, ep),
        *model_flags(model),
        "--micro-batch-size", str(micro_batch_size),
        "--global-batch-size", str(global_batch),
        "--bf16",
        "--use-distributed-optimizer",
    ]  # fmt: skip
    if len(set(llm_layers)) > 1:
        flags += [
            "--decoder-first-pipeline-num-layers", str(llm_layers[0]),
            "--decoder-last-pipeline-num-layers", str(llm_layers[-1]),
        ]  # fmt: skip
    if vpp > 1:
        flags += ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
    if recompute_num_layers:
        flags += [
            "--recompute-granularity", "full",
            "--recompute-method", "block",
            "--recompute-num-layers", str(recompute_num_layers),
        ]  # fmt: skip
    if recompute_vision:
        flags.append("--recompute-vision")
    if tp > 1:
        flags.append("--sequence-parallel")
    return flags
