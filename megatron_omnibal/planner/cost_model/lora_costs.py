"""What LoRA changes in the cost model: frozen base weights, trained adapters.

Why a transform of the FLOPs model: a LoRA run keeps every base weight in BF16 (2 bytes per
parameter) but gives it no FP32 main gradient and no Adam state; only the adapters (and parts
trained in full) cost the full 2 + 4 + 12/DP bytes. Its backward computes input gradients
everywhere but weight gradients only for what trains, so a frozen layer's backward is about one
forward instead of two; data parallelism reduces only the trained parameters' gradients. The
search then sees the memory (fewer recomputed layers, other splits) and time a LoRA run has,
and so does the hand-set Megatron baseline it is compared against.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from megatron_omnibal.models.lora import LoraSpec, lora_layers
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.cost_model.costs import MIB, CostModel
from megatron_omnibal.planner.cost_model.memory import static_bytes_per_param

WEIGHT_BYTES = 2  # a frozen BF16 weight: no gradient, no optimizer state


def _unit_params(model: ModelSpec, lora: LoraSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per partition unit (ViT layers, projector + embedding, LLM layers): base parameters,
    those trained in full, and adapter parameters."""
    v, llm = model.vit, model.llm
    adapters: dict[str, int] = {}
    for name, layer in lora_layers(model, lora).items():
        unit = ".".join(name.split(".")[:3:2])  # vit.layers.3.x -> vit.3
        width = layer.in_features + layer.out_features
        adapters[unit] = adapters.get(unit, 0) + lora.rank * width
    base, full, extra = [], [], []
    embed = llm.vocab_size * llm.hidden_size
    rows = [(f"vit.{i}", v.layer_params, v.layer_params * ("vit" in lora.train))
            for i in range(v.num_layers)]  # fmt: skip
    rows.append(("projector", model.projector_params + embed,
                 model.projector_params * ("projector" in lora.train)
                 + embed * ("llm" in lora.train)))  # fmt: skip
    rows += [(f"llm.{i}", llm.layer_params, llm.layer_params * ("llm" in lora.train))
             for i in range(llm.num_layers)]  # fmt: skip
    for unit, params, trained in rows:
        base.append(params)
        full.append(trained)
        extra.append(adapters.get(unit, 0))
    return np.array(base, float), np.array(full, float), np.array(extra, float)


def lora_costs(
    cm: CostModel, model: ModelSpec, lora: LoraSpec, tp: int, dp: int,
    distributed_optimizer: bool = True,
) -> CostModel:  # fmt: skip
    """`cm` (analytic_costs of `model` at tp, dp) for a LoRA run of `lora`."""
    base, full, extra = _unit_params(model, lora)
    trained_bytes = static_bytes_per_param(dp if distributed_optimizer else 1)
    static = ((base - full) * WEIGHT_BYTES + (full + extra) * trained_bytes) / tp / MIB
    # weight gradients in proportion to what trains: 2 forwards with all of it, 1 with none
    share = np.minimum(1.0, (full + extra) / np.maximum(base, 1.0))
    backward = np.asarray(cm.backward) * ((1.0 + share) / 2.0)[:, None]
    sync = (full + extra) * static_bytes_per_param(dp) / tp / MIB
    vit_trained, llm_trained = "vit" in lora.train, "llm" in lora.train
    first, last = np.array(cm.first, float), np.array(cm.last, float)
    if not vit_trained:
        first[1] = 0.0  # the patch embedding is first: nothing before it needs a gradient
    if not llm_trained:
        last[1] = last[1] / 2.0  # the head's input gradient, no weight gradient
    patch = model.patch_embed_params / tp / MIB
    head = model.llm.vocab_size * model.llm.hidden_size / tp / MIB
    return replace(
        cm,
        backward=backward,
        static_mib=static,
        first=first,
        last=last,
        first_static_mib=patch * (trained_bytes if vit_trained else WEIGHT_BYTES),
        last_static_mib=head * (trained_bytes if llm_trained else WEIGHT_BYTES),
        sync_mib=sync,
        first_sync_mib=patch * static_bytes_per_param(dp) if vit_trained else 0.0,
        last_sync_mib=head * static_bytes_per_param(dp) if llm_trained else 0.0,
    )
