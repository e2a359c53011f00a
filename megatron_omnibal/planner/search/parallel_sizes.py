"""Which TP / PP / DP sizes and micro-batch counts exist for a model on N GPUs.

Shared by the planner's own search and the baseline search, so both choose from the same
configurations: TP within one node and dividing every head count (Megatron splits heads and KV
groups over TP ranks), PP up to the number of partition units, DP = GPUs / (TP x PP), and model
chunks per rank (virtual pipeline size) 1 to 4 where interleaved 1F1B runs.
"""

from __future__ import annotations

from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.cost_model.hardware import Hardware

TP_SIZES = (1, 2, 4, 8)
VPP_SIZES = (1, 2, 3, 4)


def partition_units(model: ModelSpec) -> int:
    """[ViT layers, projector (+ LLM embedding), LLM layers]."""
    return model.vit.num_layers + 1 + model.llm.num_layers


def heads_divisible(model: ModelSpec, tp: int) -> bool:
    """Megatron splits attention heads (and KV groups) over TP ranks: they must divide."""
    return (
        model.vit.num_attention_heads % tp == 0
        and model.llm.num_attention_heads % tp == 0
        and model.llm.num_query_groups % tp == 0
    )


def tp_candidates(model: ModelSpec, hw: Hardware, tp: int | None = None) -> list[int]:
    if tp is not None:
        return [tp]
    return [t for t in TP_SIZES if t <= hw.gpus_per_node and heads_divisible(model, t)]


def parallel_candidates(
    model: ModelSpec,
    hw: Hardware,
    gpus: int,
    tp: int | None = None,
    pp: int | None = None,
    max_pp: int | None = None,
) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) with tp x pp x dp = gpus; pp up to `max_pp` (default: the unit count)."""
    top = partition_units(model) if max_pp is None else max_pp
    out = []
    for t in tp_candidates(model, hw, tp):
        for p in [pp] if pp else range(1, top + 1):
            if gpus % (t * p) == 0:
                out.append((t, p, gpus // (t * p)))
    return out


def ep_candidates(model: ModelSpec, dp: int, ep: int | None = None) -> list[int]:
    """Expert parallel sizes: 1 for a dense LLM; a given `ep` where it divides DP; else every
    size dividing both the experts and DP (megatron-core: EP groups within DP, expert-data-
    parallel size DP x TP / (EP x expert-TP) = DP / EP with expert-TP = TP)."""
    if not model.llm.is_moe:
        return [1]
    if ep is not None:
        return [ep] if dp % ep == 0 else []
    return [e for e in divisors(dp) if model.llm.num_experts % e == 0]


SAMPLES_PER_MICRO = (1, 2, 4)


def micro_batch_candidates(pp: int, samples_per_replica: int) -> list[int]:
    """Balanced micro-batch counts worth trying: 2 and 4 per stage (a short pipeline bubble),
    and those of about 1, 2 and 4 samples per micro-batch (what little activation memory
    leaves a large model at high TP; a hand-set Megatron-LM run gets there with micro-batch
    size 1), fewer if samples run out."""
    per_stage = {min(k * pp, samples_per_replica) for k in (2, 4)}
    small = {max(1, samples_per_replica // s) for s in SAMPLES_PER_MICRO}
    return sorted(m for m in per_stage | small if m >= 1)


def vpp_candidates(model: ModelSpec, pp: int, m: int, vpp: int | None = None) -> list[int]:
    """Model chunks per rank: a given `vpp` (checked where it is searched), or those of 1-4
    where interleaved 1F1B runs (pp >= 2, micro-batches divisible by pp) and every virtual
    stage gets a unit."""
    if vpp is not None:
        return [vpp]
    return [
        v
        for v in VPP_SIZES
        if v == 1 or (pp >= 2 and m % pp == 0 and pp * v <= partition_units(model))
    ]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
