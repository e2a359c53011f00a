"""Model provider: build this pipeline rank's VLM stage from a spec and a layout.

Why: megatron.training.pretrain (and any driver using parallel_state) asks a provider for "the
model of this rank"; the layout (from plan.json or --omnibal-*-pp-layers) says what that is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_omnibal.megatron.stages.configs import stage_configs
from megatron_omnibal.megatron.stages.finetune import FinetuneSettings, apply_to_stage
from megatron_omnibal.megatron.stages.layout import LayoutError, rank_stages
from megatron_omnibal.megatron.stages.model import VLMStage
from megatron_omnibal.models.lora import LoraSpec
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout


def vlm_model_provider(
    spec: ModelSpec,
    layouts: list[StageLayout],
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    config_overrides: dict[str, Any] | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    finetune: FinetuneSettings | None = None,
    level_recompute: Sequence[Sequence[tuple[int, int]]] = (),
    lora: LoraSpec | None = None,
    seed: int = 0,
) -> VLMStage:
    """This rank's stage, or with virtual stages (pp x vpp `layouts`, interleaved 1F1B) its
    model chunk `vp_stage`: virtual stage vp_stage x pp + rank. pre_process/post_process are
    accepted for megatron.training's signature and checked against the layout (the layout
    decides what the stage holds);
    pg_collection is megatron.training's (None: parallel_state's groups); `finetune` freezes
    parts and marks the ViT for its learning-rate multiplier; `level_recompute[stage]` the
    stage's (ViT, LLM) recompute per packing level (layout.level_recompute; empty: the
    layout's counts throughout); `lora` gives the targeted layers adapters (initial values
    from `seed` and each layer's name) and freezes the rest but `lora.train`'s parts."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    if len(layouts) != pp * vpp:
        raise LayoutError(
            f"layout has {len(layouts)} stages, the pipeline has {pp} ranks x {vpp} chunks"
        )
    if (vp_stage is None) != (vpp == 1) or not 0 <= (vp_stage or 0) < vpp:
        raise LayoutError(f"model chunk {vp_stage} of a pipeline with {vpp} chunks per rank")
    rank = parallel_state.get_pipeline_model_parallel_rank()
    virtual = rank_stages(len(layouts), pp, rank)[vp_stage or 0]
    if pre_process != (virtual == 0) or post_process != (virtual == len(layouts) - 1):
        raise LayoutError(
            f"pipeline rank {rank}/{pp}, chunk {vp_stage}: pre_process={pre_process}, "
            f"post_process={post_process} disagree with its position in the pipeline"
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    configs = stage_configs(spec, layouts, virtual, tp, config_overrides, vpp, ep)
    stage = VLMStage(
        spec,
        layouts,
        virtual,
        configs,
        pg_collection=pg_collection,
        level_recompute=level_recompute[virtual] if level_recompute else (),
        vp_stage=vp_stage,
    )
    if spec.llm.is_moe:
        mark_experts(stage)
    if lora is not None:
        from megatron_omnibal.megatron.stages.lora import apply_lora

        apply_lora(stage, lora, seed)
    if finetune is not None:
        apply_to_stage(stage, finetune)
    return stage


def mark_experts(stage: VLMStage) -> None:
    """Expert parameters as megatron-core marks them under EP > 1 (`allreduce=False`), at EP=1
    too: Megatron's DDP then reduces them over the expert-data-parallel group (at EP=1 the
    data-parallel one: the same sum) and its optimizer keeps them in an optimizer of their own
    at every EP, so a checkpoint's optimizer state loads at another EP."""
    for name, param in stage.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False
