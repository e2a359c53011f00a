"""Worker: Qwen3-VL's stages at several layouts (pipeline, virtual stages, TP with sequence
parallelism) on real megatron-core schedules, from one set of transformers weights.

Usage: qwen3_vl_worker.py CASES.json OUT_DIR
CASES.json: {"spec": <model_spec dict>, "weights": torch-saved canonical tensors,
             "seed": s, "batches": [[[units, tokens, units] per sample] per micro-batch],
             "extra_probe"?: torch-saved samples (dicts) appended to the forward's probe,
             "cases": [{"name", "tp", "pp", "vpp"?, "vit", "llm" (counts per virtual stage),
                        "vit_recompute"?, "llm_recompute"?, "sequence_parallel"?}]}
Per case and pipeline rank it saves `<name>.stage<rank>.pt`: {"losses": per-micro-batch
[loss sum, tokens] (last stage), "grads": every parameter's whole gradient by global name,
"forward": the logits / ViT / LLM outputs of one forward of all samples packed, the extra probe
samples last (without virtual stages), "checkpoint_keys": (key, global offset, global shape) of
every shard of TP rank 0's sharded state dict}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron

enable_cpu_megatron()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from model_worker import checkpoint_shards  # noqa: E402
from parallel_groups import reset_model_parallel, run_cases  # noqa: E402

from megatron_omnibal.data.lengths import from_arrays  # noqa: E402
from megatron_omnibal.megatron.checkpoint.stage_runtime import forward_outputs  # noqa: E402
from megatron_omnibal.megatron.checkpoint.stage_weights import load_into  # noqa: E402
from megatron_omnibal.megatron.checkpoint.tp_shard import unshard  # noqa: E402
from megatron_omnibal.megatron.stages.layout import layout_from_counts, rank_stages  # noqa: E402
from megatron_omnibal.megatron.stages.model import global_named_parameters  # noqa: E402
from megatron_omnibal.megatron.stages.provider import vlm_model_provider  # noqa: E402
from megatron_omnibal.megatron.stages.step import forward_step  # noqa: E402
from megatron_omnibal.megatron.stream.batch import Sample, collate, synthetic_sample  # noqa: E402
from megatron_omnibal.models.spec import ModelSpec  # noqa: E402


def build(spec: ModelSpec, case: dict, seed: int) -> list[torch.nn.Module]:
    """This rank's model chunks (one without virtual stages)."""
    reset_model_parallel()
    vpp = case.get("vpp", 1)
    ps.initialize_model_parallel(
        case["tp"], case["pp"], virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None
    )
    model_parallel_cuda_manual_seed(seed)
    layouts = layout_from_counts(
        case["vit"], case["llm"], case.get("vit_recompute"), case.get("llm_recompute"),
        spec.vit.num_layers, spec.llm.num_layers,
    )  # fmt: skip
    rank = ps.get_pipeline_model_parallel_rank()
    chunks = []
    for chunk, stage in enumerate(rank_stages(len(layouts), case["pp"], rank)):
        chunks.append(vlm_model_provider(
            spec, layouts, stage == 0, stage == len(layouts) - 1,
            vp_stage=chunk if vpp > 1 else None,
            config_overrides={"sequence_parallel": case.get("sequence_parallel", False)},
        ))  # fmt: skip
    return chunks


def whole(name: str, part: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    tp = ps.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(part) for _ in range(tp)]
    dist.all_gather(parts, part.contiguous(), group=ps.get_tensor_model_parallel_group())
    return unshard(name, parts, spec)


def sum_sequence_parallel_grads(named: dict) -> None:
    """What finalize_model_grads does for parameters marked sequence_parallel."""
    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    for p in named.values():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def run_case(spec: ModelSpec, case: dict, weights: dict, batches: list, probe, seed: int,
             out: Path) -> None:  # fmt: skip
    chunks = build(spec, case, seed)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    result: dict = {"losses": [], "grads": {}, "forward": {}}
    for chunk in chunks:
        load_into(chunk, spec, weights, tp, tp_rank)
    if len(chunks) == 1:
        result["forward"] = forward_outputs(chunks[0], probe, spec.llm.vocab_size)
    for chunk in chunks:
        chunk.train()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
        model=chunks,
        num_microbatches=len(batches),
        seq_length=max(b.tokens.shape[1] for b in batches),
        micro_batch_size=1,
    )
    result["losses"] = [x["lm loss"].tolist() for x in losses] if losses else []
    for chunk in chunks:
        named = global_named_parameters(chunk)
        sum_sequence_parallel_grads(named)
        for n, p in named.items():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            result["grads"][n] = whole(n, g.detach(), spec)
    result["checkpoint_keys"] = sorted(k for chunk in chunks for k in checkpoint_shards(chunk))
    if ps.get_data_parallel_rank() == 0 and tp_rank == 0:
        torch.save(result, out / f"{case['name']}.stage{ps.get_pipeline_model_parallel_rank()}.pt")


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    spec = ModelSpec.from_dict(cfg["spec"])
    seed = cfg["seed"]
    weights = torch.load(cfg["weights"])
    records = [r for mb in cfg["batches"] for r in mb]
    lengths = from_arrays(*([r[k] for r in records] for k in range(3)))
    samples, batches = [], []
    for mb in cfg["batches"]:
        first = len(samples)
        samples += [synthetic_sample(first + k, lengths, spec, seed) for k in range(len(mb))]
        batches.append(collate(samples[first:]))
    extra = [Sample(**s) for s in torch.load(cfg["extra_probe"])] if "extra_probe" in cfg else []
    probe = collate(samples + extra)
    run_cases(cfg["cases"], lambda case: run_case(spec, case, weights, batches, probe, seed, out))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
