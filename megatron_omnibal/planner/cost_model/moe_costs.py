"""What a mixture-of-experts LLM layer adds to the cost model: expert weights sharded by expert
parallelism, the token dispatcher's all-to-all, the routed tokens' activations.

Megatron-core 0.19 carves the expert-parallel (EP) groups out of the data-parallel ranks: the
experts of a layer are split over `ep` ranks (and over TP: the expert tensor-parallel size
defaults to TP), and their gradients are reduced and their optimizer state sharded over the
expert-data-parallel group of DP x TP / (EP x expert-TP) = DP / EP ranks
(`parallel_state.initialize_model_parallel`). Its EP groups are consecutive after TP in the rank
order tp-cp-ep-dp-pp, so they stay within a node while TP x EP fits one. The alltoall
dispatcher sends each token to its top-k experts and back (dispatch and combine) in the forward,
and the gradients the same way in the backward. Pure numpy: no torch, no Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_omnibal.models.spec import LanguageSpec
from megatron_omnibal.planner.cost_model.hardware import Hardware
from megatron_omnibal.planner.cost_model.memory import static_bytes_per_param

BF16 = 2


@dataclass(frozen=True)
class ExpertLayout:
    """How a MoE layer's experts are spread: `ep` ranks share a layer's experts, each of them
    split over `tp`; `dp` data-parallel replicas of the whole model."""

    tp: int
    ep: int
    dp: int

    @property
    def expert_dp(self) -> int:
        """Ranks holding the same expert shard (megatron-core's expert-data-parallel size)."""
        return self.dp // self.ep


def expert_link_gbs(hw: Hardware, tp: int, ep: int) -> float:
    """An EP group of TP x EP consecutive ranks: NVLink while that fits a node."""
    return hw.nvlink_gbs if tp * ep <= hw.gpus_per_node else hw.network_gbs


def layer_static_bytes(llm: LanguageSpec, layout: ExpertLayout, sharded: bool) -> float:
    """Static bytes (weights, main gradients, Adam state; `sharded`: distributed optimizer) one
    GPU holds for one MoE layer: its attention, norms and router over TP and DP, its share of
    the experts over TP x EP, their optimizer state over the expert-data-parallel group."""
    experts = llm.num_experts * llm.expert_params
    dense = llm.layer_params - experts
    dense_bytes = dense / layout.tp * static_bytes_per_param(layout.dp if sharded else 1)
    expert_shard = experts / (layout.tp * layout.ep)
    return dense_bytes + expert_shard * static_bytes_per_param(
        layout.expert_dp if sharded else 1
    )


def layer_sync_bytes(llm: LanguageSpec, layout: ExpertLayout) -> float:
    """The layer's static bytes as the DP gradient sync prices them (bytes per parameter of
    static_bytes_per_param(dp), times (dp - 1) / dp): the experts' gradients are reduced over
    the expert-data-parallel group of dp / ep ranks, so their share is scaled to that group's
    (edp - 1) / edp (none when one rank holds each shard)."""
    experts = llm.num_experts * llm.expert_params
    dense = llm.layer_params - experts
    per_param = static_bytes_per_param(layout.dp)
    dp, edp = layout.dp, layout.expert_dp
    scale = 0.0 if dp == 1 else (edp - 1) / edp / ((dp - 1) / dp)
    return per_param * (dense / layout.tp + experts / (layout.tp * layout.ep) * scale)


def alltoall_ms_per_token(llm: LanguageSpec, hw: Hardware, tp: int, ep: int) -> float:
    """Forward ms per LLM token of one MoE layer's dispatch + combine all-to-all: each rank's
    tokens (1/tp of them under sequence parallelism) go to their top-k experts, BF16 hidden
    states, the (ep - 1) / ep share that leaves the rank over the EP group's link. The backward
    sends the gradients the same way once more."""
    if ep == 1:
        return 0.0
    sent = 2 * llm.moe_top_k * llm.hidden_size * BF16 / tp * (ep - 1) / ep
    return sent / (expert_link_gbs(hw, tp, ep) * 1e9) * 1e3


def routed_values_per_token(llm: LanguageSpec) -> int:
    """Values a MoE MLP stores per token for its backward: the router's logits, and for each of
    the top-k copies the permuted input and the expert's activations (fc1 out, activation)."""
    inner = (3 if llm.gated_mlp else 2) * llm.moe_ffn_hidden_size
    return llm.num_experts + llm.moe_top_k * (llm.hidden_size + inner)
