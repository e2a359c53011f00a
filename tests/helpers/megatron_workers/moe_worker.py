"""torchrun worker: a mixture-of-experts VLM on real megatron-core (CPU, gloo) at several
TP x PP x EP layouts, saving what a DDP step would reduce, for tests to compare across layouts.

Usage: local ranks N moe_worker.py CASES.json OUT_DIR
CASES.json: {"spec": <model_spec dict>, "seed": s,
             "shards": [[[vit_num, token_num, image_flags] per sample] per micro-batch] x N,
             "cases": [{"name", "tp", "pp", "ep", "vit", "llm", "sp"?, "aux_coeff"?}, ...]}
Every case trains the same N data shards: data-parallel rank d of D runs shards d x N/D ...
(d + 1) x N/D - 1 as its micro-batches. Saved per rank that holds them: the losses of each
shard's micro-batches, every gradient summed as DDP sums it (dense parameters over DP and,
under sequence parallelism, over TP; experts over the expert-data-parallel group) under its
global name (experts by their global index), the routers' inputs per micro-batch (to recount
their choices in the test), the aux losses the MoE metrics tracker recorded per layer, the
step's tokens per expert ExpertLoad counted, the routers' weights and the stage's checkpoint
shards.
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
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker  # noqa: E402
from model_worker import checkpoint_shards, reference_weights  # noqa: E402
from parallel_groups import reset_model_parallel, run_cases  # noqa: E402
from schedule import run_schedule  # noqa: E402

from megatron_omnibal.data.lengths import from_arrays  # noqa: E402
from megatron_omnibal.megatron.checkpoint.tp_shard import shard, unshard  # noqa: E402
from megatron_omnibal.megatron.stages.expert_load import ExpertLoad  # noqa: E402
from megatron_omnibal.megatron.stages.layout import layout_from_counts  # noqa: E402
from megatron_omnibal.megatron.stages.model import global_named_parameters  # noqa: E402
from megatron_omnibal.megatron.stages.provider import vlm_model_provider  # noqa: E402
from megatron_omnibal.megatron.stages.step import forward_step  # noqa: E402
from megatron_omnibal.megatron.stream.batch import collate, synthetic_sample  # noqa: E402
from megatron_omnibal.models.spec import ModelSpec  # noqa: E402


def build(spec: ModelSpec, case: dict, seed: int) -> torch.nn.Module:
    reset_model_parallel()
    ps.initialize_model_parallel(
        case["tp"], case["pp"], expert_model_parallel_size=case.get("ep", 1)
    )
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    layouts = layout_from_counts(
        case["vit"], case["llm"], None, None, spec.vit.num_layers, spec.llm.num_layers
    )
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), case["pp"]
    overrides = {"sequence_parallel": case.get("sp", False)}
    return vlm_model_provider(
        spec, layouts, pp_rank == 0, pp_rank == pp - 1, config_overrides=overrides
    )


def is_expert(p: torch.nn.Parameter) -> bool:
    """megatron-core marks expert parameters `allreduce=False` (reduced over expert DP)."""
    return not getattr(p, "allreduce", True)


def whole(part: torch.Tensor, name: str, spec: ModelSpec, group) -> torch.Tensor:
    """The whole tensor from the (expert) tensor-parallel pieces."""
    size = dist.get_world_size(group)
    if size == 1:
        return unshard(name, [part], spec)
    parts = [torch.empty_like(part) for _ in range(size)]
    dist.all_gather(parts, part.contiguous(), group=group)
    return unshard(name, parts, spec)


def record_router_inputs(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """Each router's input per forward, by its layer's global name (hooks on the model)."""
    seen: dict[str, list[torch.Tensor]] = {}
    for name, module in model.named_modules():
        if name.endswith("mlp.router"):
            layer = name.split(".")[2]
            key = f"llm.layers.{model.llm.layers[int(layer)].layer_number - 1}"

            def hook(_m, args, _out, key=key):
                seen.setdefault(key, []).append(args[0].detach().clone())

            module.register_forward_hook(hook)
    return seen


def run_case(spec: ModelSpec, case: dict, weights: dict, shards: list, seed: int, out: Path):
    model = build(spec, case, seed)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    named = global_named_parameters(model)
    with torch.no_grad():
        for n, p in named.items():
            group_tp = ps.get_expert_tensor_parallel_world_size() if is_expert(p) else tp
            group_rank = ps.get_expert_tensor_parallel_rank() if is_expert(p) else tp_rank
            p.copy_(shard(n, weights[n], spec, group_tp, group_rank))
    model.train()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = len(shards) // dp
    mine = list(range(dp_rank * per, (dp_rank + 1) * per))
    routers = record_router_inputs(model)
    load = ExpertLoad([model])
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    losses = run_schedule(forward_step, model, [mb for i in mine for mb in shards[i]])
    grads, rank = {}, dist.get_rank()
    for n, p in named.items():
        g = (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        if is_expert(p):
            dist.all_reduce(g, group=ps.get_expert_data_parallel_group())
            keep = ps.get_expert_data_parallel_rank() == 0
            g = whole(g, n, spec, ps.get_expert_tensor_parallel_group())
            keep = keep and ps.get_expert_tensor_parallel_rank() == 0
        else:
            dist.all_reduce(g, group=ps.get_data_parallel_group())
            if getattr(p, "sequence_parallel", False) and tp > 1:  # each TP rank's tokens
                dist.all_reduce(g, group=ps.get_tensor_model_parallel_group())
            keep = dp_rank == 0
            g = whole(g, n, spec, ps.get_tensor_model_parallel_group())
            keep = keep and tp_rank == 0
        if keep:
            grads[n] = g
    aux = {name: entry.values.detach().clone() for name, entry in tracker.metrics.items()}
    counts = [len(shards[i]) for i in mine]
    result = {
        "grads": grads,
        "losses": {},
        "aux": aux if tp_rank == 0 else {},
        "routers": routers if tp_rank == 0 else {},
        "shards": mine,
        "micro_batches": counts,
        "checkpoint_keys": checkpoint_shards(model),
        # [layers, experts] tokens of the whole step (a collective over every rank)
        "expert_tokens": load.step_tokens(spec.llm.num_layers, spec.llm.num_experts),
        "router_weights": {
            n.removesuffix(".mlp.router.weight"): p.detach().clone()
            for n, p in named.items()
            if n.endswith(".mlp.router.weight")
        },
    }
    if losses and tp_rank == 0:
        flat = [x["lm loss"].tolist() for x in losses]
        at = 0
        for i, c in zip(mine, counts, strict=True):
            result["losses"][i] = flat[at : at + c]
            at += c
    torch.save(result, out / f"{case['name']}.rank{rank}.pt")


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    spec = ModelSpec.from_dict(cfg["spec"])
    seed = cfg["seed"]
    records = [r for sh in cfg["shards"] for mb in sh for r in mb]
    lengths = from_arrays([r[0] for r in records], [r[1] for r in records], [r[2] for r in records])
    shards, i = [], 0
    for sh in cfg["shards"]:
        batches = []
        for mb in sh:
            batches.append(
                collate([synthetic_sample(i + k, lengths, spec, seed) for k in range(len(mb))])
            )
            i += len(mb)
        shards.append(batches)
    weights = reference_weights(spec, seed)

    def run(case: dict) -> None:
        case_spec = spec
        if "aux_coeff" in case:  # the same weights, another load-balancing coefficient
            llm = replace(spec.llm, moe_aux_loss_coeff=case["aux_coeff"])
            case_spec = replace(spec, llm=llm)
        run_case(case_spec, case, weights, shards, seed, out)

    run_cases(cfg["cases"], run)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
