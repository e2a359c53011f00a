"""Build the VLM stages of a layout in a running torch.distributed job, fill them, run them.

Why one module: the torch_dist converter, `omnibal compare-hf` and the tests all need "this rank's
stage at layout L, TP t, with these weights", and a forward pass through megatron-core's real
pipeline schedule that returns logits and per-tower outputs instead of a loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from megatron_omnibal.megatron.stages.layout import embedding_ranks
from megatron_omnibal.megatron.stream.batch import MicroBatch
from megatron_omnibal.models.lora import LoraSpec
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout


def init_parallel(layouts: Sequence[StageLayout], tp: int, ep: int = 1) -> None:
    """Model-parallel groups for TP `tp`, the layout's PP size and EP `ep` (a mixture of
    experts' ranks: the world is TP x PP x EP, data-parallel over EP for the dense parts), with
    the embedding group between the embedding's stage and the head's (tied heads)."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tp, len(layouts), get_embedding_ranks=embedding_ranks(layouts, len(layouts)),
        expert_model_parallel_size=ep,
    )
    model_parallel_cuda_manual_seed(0)


def build_stage(
    spec: ModelSpec, layouts: Sequence[StageLayout], sequence_parallel: bool = False,
    lora: LoraSpec | None = None,
) -> torch.nn.Module:
    """This rank's VLMStage (after init_parallel), with `lora`'s adapters."""
    from megatron.core import parallel_state as ps

    from megatron_omnibal.megatron.stages.provider import vlm_model_provider

    rank, pp = ps.get_pipeline_model_parallel_rank(), len(layouts)
    return vlm_model_provider(
        spec,
        list(layouts),
        rank == 0,
        rank == pp - 1,
        config_overrides={"sequence_parallel": sequence_parallel},
        lora=lora,
    )


def load_hf_base(model: torch.nn.Module, hf_dir: Path) -> None:
    """Fill the stage's base weights from a Hugging Face checkpoint (the base an adapter-only
    LoRA checkpoint trained on); the adapters keep their values."""
    from megatron.core import parallel_state as ps

    from megatron_omnibal.megatron.checkpoint.stage_weights import load_into
    from megatron_omnibal.megatron.stages.model import global_named_parameters
    from megatron_omnibal.models.hf_config import read_hf
    from megatron_omnibal.models.hf_weights import SafetensorsReader, canonical_tensors
    from megatron_omnibal.models.lora import is_adapter

    hf = read_hf(hf_dir)
    wanted = {n for n in global_named_parameters(model) if not is_adapter(n)}
    wanted.add("embedding.word_embeddings.weight")  # a tied head's source
    tensors = dict(canonical_tensors(hf, SafetensorsReader(hf), lambda n: n in wanted))
    load_into(model, model.spec, tensors, ps.get_tensor_model_parallel_world_size(),
              ps.get_tensor_model_parallel_rank(), skip=is_adapter)  # fmt: skip


def load_megatron_checkpoint(
    model: torch.nn.Module, path: Path, fmt: str, pp: int, adapters_only: bool = False
) -> None:
    """Fill `model` from an iteration directory of a Megatron checkpoint: a torch-format
    checkpoint at this very layout (its `pp` ranks' files; with model chunks, fewer ranks than
    stages, this rank's stage is virtual stage v, chunk v // pp of rank v % pp's file; under EP
    the file of this rank's EP rank, with its experts), or a
    torch_dist checkpoint at any layout. `adapters_only`: the checkpoint holds what a LoRA run
    trained (the base weights are in the model already)."""
    from megatron.core import parallel_state as ps

    from megatron_omnibal.megatron.checkpoint.hf_checkpoint import rank_dir

    if fmt == "torch":
        stage = ps.get_pipeline_model_parallel_rank()
        f = rank_dir(path, ps.get_tensor_model_parallel_rank(), stage % pp, pp,
                     ps.get_expert_model_parallel_rank(),
                     ps.get_expert_model_parallel_world_size())  # fmt: skip
        state = torch.load(f / "model_optim_rng.pt", map_location="cpu", weights_only=False)
        chunked = ps.get_pipeline_model_parallel_world_size() > pp
        model.load_state_dict(state[f"model{stage // pp}" if chunked else "model"],
                              strict=not adapters_only)  # fmt: skip
        return
    from megatron.core import dist_checkpointing

    if adapters_only:
        from megatron_omnibal.megatron.stages.lora import checkpoint_view

        with checkpoint_view([model], "trainable"):
            wanted = model.sharded_state_dict()
    else:
        wanted = model.sharded_state_dict()
    loaded = dist_checkpointing.load({"model": wanted}, str(path))
    model.load_state_dict(loaded["model"], strict=False)


def forward_outputs(
    model: torch.nn.Module, batch: MicroBatch, vocab_size: int
) -> dict[str, torch.Tensor]:
    """One forward pass of `batch` through megatron-core's pipeline schedule: this stage's
    share of {"logits" [S, vocab] (head stage), "vit" [tiles, tokens, C] (projector stage),
    "llm" [S, H] (head stage)}."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_omnibal.megatron.stages.step import stage_inputs

    kept: dict[str, torch.Tensor] = {}

    def forward_step(data_iterator, stage):
        _, inputs = stage_inputs(next(data_iterator), stage.spec, with_labels=False)
        output = stage(**inputs)

        def keep(output_tensor: torch.Tensor):
            kept["logits"] = output_tensor.detach()[0, :, :vocab_size]
            return output_tensor.sum() * 0, torch.tensor(1), {}

        return output, keep

    model.eval()
    model.capture = {}
    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([batch]),
            model=[model],
            num_microbatches=1,
            seq_length=batch.tokens.shape[1],
            micro_batch_size=1,
            forward_only=True,
        )
    kept.update(model.capture)
    model.capture = None
    return kept
