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
FULL = ("vit", "projector", "llm")  # what full-parameter training trains


def _unit_params(
    model: ModelSpec, lora: LoraSpec | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per partition unit (ViT layers, projector + embedding, LLM layers): base parameters,
    those trained in full, and adapter parameters (`lora` None: everything in full)."""
    v, llm = model.vit, model.llm
    train = FULL if lora is None else lora.train
    rank, adapted = (0, {}) if lora is None else (lora.rank, lora_layers(model, lora))
    adapters: dict[str, int] = {}
    for name, layer in adapted.items():
        unit = ".".join(name.split(".")[:3:2])  # vit.layers.3.x -> vit.3
        width = layer.in_features + layer.out_features
        adapters[unit] = adapters.get(unit, 0) + rank * width
    base, full, extra = [], [], []
    embed = llm.vocab_size * llm.hidden_size
    rows = [(f"vit.{i}", v.layer_params, v.layer_params * ("vit" in train))
            for i in range(v.num_layers)]  # fmt: skip
    rows.append(("projector", model.projector_params + embed,
                 model.projector_params * ("projector" in train)
                 + embed * ("llm" in train)))  # fmt: skip
    rows += [(f"llm.{i}", llm.layer_params, llm.layer_params * ("llm" in train))
             for i in range(llm.num_layers)]  # fmt: skip
    for unit, params, trained in rows:
        base.append(params)
        full.append(trained)
        extra.append(adapters.get(unit, 0))
    return np.array(base, float), np.array(full, float), np.array(extra, float)


def static_parts_mib(
    model: ModelSpec, lora: LoraSpec | None, tp: int, dp: int, distributed_optimizer: bool = True,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Per partition unit, the static MiB of a LoRA run by part: "weights" (every parameter's
    BF16 copy, frozen or trained), "gradients" (FP32 main gradients of what trains) and
    "optimizer" (FP32 main copy and Adam's two moments of what trains, over DP with the
    distributed optimizer). Their sum is `lora_costs`' static memory; the parts are what a
    preflight measures separately. `lora` None: full-parameter training."""
    base, full, extra = _unit_params(model, lora)
    trained = full + extra
    shards = dp if distributed_optimizer else 1
    return {"weights": (base + extra) * WEIGHT_BYTES / tp / MIB,
            "gradients": trained * 4 / tp / MIB,
            "optimizer": trained * 12 / shards / tp / MIB}  # fmt: skip


def lora_costs(
    cm: CostModel, model: ModelSpec, lora: LoraSpec, tp: int, dp: int,
    distributed_optimizer: bool = True,
) -> CostModel:  # fmt: skip
    """`cm` (analytic_costs of `model` at tp, dp) for a LoRA run of `lora`."""
    base, full, extra = _unit_params(model, lora)
    trained_bytes = static_bytes_per_param(dp if distributed_optimizer else 1)
    static = sum(static_parts_mib(model, lora, tp, dp, distributed_optimizer).values())
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
