"""torchrun worker: run VLM pipeline cases on real megatron-core (CPU, gloo) and save, per
pipeline stage, the per-micro-batch losses and every gradient under its global name.

Usage: torchrun --nproc-per-node N model_worker.py CASES.json OUT_DIR
CASES.json: {"spec": <model_spec dict>, "seed": s,
             "batches": [[[vit_num, token_num, image_flags] per sample] per micro-batch],
             "cases": [{"name", "tp", "pp", "vit", "llm", "vit_recompute"?, "llm_recompute"?,
                        "dropout"?, "split_samples"?, "llm_layers"?}, ...]}
"llm_layers" gives the case's model another LLM depth (its own reference weights).
One process group serves every case (model-parallel groups are rebuilt per case), so the
expensive start-up is paid once. Tests compare the saved results across cases.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron

enable_cpu_megatron()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from parallel_groups import reset_model_parallel, run_cases  # noqa: E402
from schedule import run_schedule  # noqa: E402

from megatron_omnibal.data.lengths import from_arrays  # noqa: E402
from megatron_omnibal.megatron.checkpoint.tp_shard import shard, unshard  # noqa: E402
from megatron_omnibal.megatron.stages.layout import layout_from_counts  # noqa: E402
from megatron_omnibal.megatron.stages.model import global_named_parameters  # noqa: E402
from megatron_omnibal.megatron.stages.provider import vlm_model_provider  # noqa: E402
from megatron_omnibal.megatron.stages.step import forward_step  # noqa: E402
from megatron_omnibal.megatron.stream.batch import collate, synthetic_sample  # noqa: E402
from megatron_omnibal.models.spec import ModelSpec  # noqa: E402


def gather(part: torch.Tensor, p: torch.nn.Parameter, name: str, spec: ModelSpec) -> torch.Tensor:
    """The whole tensor from every TP rank's piece (megatron.tp_shard.unshard)."""
    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return unshard(name, [part], spec)
    parts = [torch.empty_like(part) for _ in range(tp)]
    dist.all_gather(parts, part.contiguous(), group=ps.get_tensor_model_parallel_group())
    return unshard(name, parts, spec)


def build(spec: ModelSpec, case: dict, seed: int) -> torch.nn.Module:
    reset_model_parallel()
    ps.initialize_model_parallel(case["tp"], case["pp"])
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    layouts = layout_from_counts(
        case["vit"],
        case["llm"],
        case.get("vit_recompute"),
        case.get("llm_recompute"),
        spec.vit.num_layers,
        spec.llm.num_layers,
    )
    p = case.get("dropout", 0.0)
    overrides = {"hidden_dropout": p, "attention_dropout": p}
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), case["pp"]
    return vlm_model_provider(
        spec, layouts, pp_rank == 0, pp_rank == pp - 1, config_overrides=overrides
    )


def reference_weights(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Whole (canonical) weights of a TP=1 model, perturbed so that no norm weight is a trivial
    1 or bias a 0."""
    model = build(
        spec, {"tp": 1, "pp": 1, "vit": [spec.vit.num_layers], "llm": [spec.llm.num_layers]}, seed
    )
    g = torch.Generator().manual_seed(seed + 1)
    return {
        n: unshard(n, [p.detach() + 0.05 * torch.randn(p.shape, generator=g)], spec)
        for n, p in sorted(global_named_parameters(model).items())
    }


def checkpoint_shards(model: torch.nn.Module) -> list[tuple]:
    """(key, global offset, global shape) of every shard in the model's sharded state dict
    (factories, e.g. the SwiGLU fc1 split, built into their shards)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_base

    def walk(x):
        if isinstance(x, ShardedTensorFactory):
            yield from walk(x.build())
        elif isinstance(x, dict):
            for v in x.values():
                yield from walk(v)
        elif isinstance(x, list):
            for v in x:
                yield from walk(v)
        else:
            yield x

    shards, _ = extract_sharded_base(list(walk(model.sharded_state_dict())))
    return sorted(
        (v.key, tuple(v.global_offset), tuple(getattr(v, "global_shape", ()))) for v in walk(shards)
    )


def run_case(spec: ModelSpec, case: dict, weights: dict, batches: list, seed: int, out: Path):
    model = build(spec, case, seed)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    named = global_named_parameters(model)
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(shard(n, weights[n], spec, tp, tp_rank))
    model.train()
    # Fresh RNG per case, the same on every rank: dropout masks depend only on the seed.
    model_parallel_cuda_manual_seed(seed + 7)
    torch.manual_seed(seed + 7)
    losses = run_schedule(forward_step, model, batches)
    grads = {}
    for n, p in named.items():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        grads[n] = gather(g.detach(), p, n, spec)
    if ps.get_data_parallel_rank() == 0 and tp_rank == 0:
        result = {
            "losses": [x["lm loss"].tolist() for x in losses] if losses else [],
            "grads": grads,
            # Checkpoint shards (megatron-core stacks a tower's layers along a global layer
            # axis: the offset holds the global layer index) and layer numbers.
            "checkpoint_keys": checkpoint_shards(model),
            # megatron.training's train() takes the model's mp, pp and dp_cp groups.
            "process_groups": [
                model.pg_collection.mp is ps.get_model_parallel_group(),
                model.pg_collection.pp is ps.get_pipeline_model_parallel_group(),
                model.pg_collection.tp is ps.get_tensor_model_parallel_group(),
                model.pg_collection.dp_cp is ps.get_data_parallel_group(with_context_parallel=True),
            ],
            "layer_numbers": {
                tower: [layer.layer_number for layer in getattr(model, tower).layers]
                for tower in ("vit", "llm")
                if getattr(model, tower) is not None
            },
        }
        torch.save(result, out / f"{case['name']}.stage{ps.get_pipeline_model_parallel_rank()}.pt")


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    spec = ModelSpec.from_dict(cfg["spec"])
    seed = cfg["seed"]
    records = [r for mb in cfg["batches"] for r in mb]
    lengths = from_arrays([r[0] for r in records], [r[1] for r in records], [r[2] for r in records])
    samples, packed, i = [], [], 0
    for mb in cfg["batches"]:
        samples.append([synthetic_sample(i + k, lengths, spec, seed) for k in range(len(mb))])
        packed.append(collate(samples[-1]))
        i += len(mb)
    # The same samples, one per micro-batch: packing must not change any loss or gradient.
    split = [collate([s]) for mb in samples for s in mb]
    weights: dict[int, dict] = {}

    def run(case: dict) -> None:
        case_spec = spec
        if "llm_layers" in case:
            case_spec = replace(spec, llm=replace(spec.llm, num_layers=case["llm_layers"]))
        depth = case_spec.llm.num_layers
        if depth not in weights:
            weights[depth] = reference_weights(case_spec, seed)
        if case["tp"] * case["pp"] > dist.get_world_size():
            raise ValueError(f"case {case['name']}: needs {case['tp'] * case['pp']} ranks")
        batches = split if case.get("split_samples") else packed
        run_case(case_spec, case, weights[depth], batches, seed, out)

    run_cases(cfg["cases"], run)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
