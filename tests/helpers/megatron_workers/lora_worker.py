"""torchrun worker: LoRA stages on real megatron-core pipelines (CPU, gloo); per case and
pipeline stage, the per-micro-batch losses, every adapter's gradient and merged weight (whole,
under its model-wide name) and the names of the parameters that require a gradient.

Usage: torchrun --nproc-per-node N lora_worker.py CASES.json OUT_DIR
CASES.json: {"spec", "seed", "batches", "lora": {LoraSpec}, "cases": [{"name", "tp", "pp",
"vit", "llm", "vit_recompute"?, "llm_recompute"?, "sequence_parallel"?, "lora"?: false | {..}
(false: no adapters, the merged weights loaded instead), "dropout"?}]}
Every case starts from the same whole weights: a base model and adapters with random A and B.
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
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from model_worker import gather  # noqa: E402
from parallel_groups import reset_model_parallel, run_cases  # noqa: E402
from schedule import run_schedule  # noqa: E402

from megatron_omnibal.data.lengths import from_arrays  # noqa: E402
from megatron_omnibal.megatron.checkpoint.tp_shard import shard, unshard  # noqa: E402
from megatron_omnibal.megatron.stages.layout import layout_from_counts  # noqa: E402
from megatron_omnibal.megatron.stages.model import global_named_parameters  # noqa: E402
from megatron_omnibal.megatron.stages.provider import vlm_model_provider  # noqa: E402
from megatron_omnibal.megatron.stages.step import forward_step  # noqa: E402
from megatron_omnibal.megatron.stream.batch import collate, synthetic_sample  # noqa: E402
from megatron_omnibal.models.lora import LoraSpec, lora_layers  # noqa: E402
from megatron_omnibal.models.lora_export import merged_weight  # noqa: E402
from megatron_omnibal.models.spec import ModelSpec  # noqa: E402


def build(spec: ModelSpec, case: dict, seed: int, lora: LoraSpec | None) -> torch.nn.Module:
    reset_model_parallel()
    ps.initialize_model_parallel(case["tp"], case["pp"])
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    layouts = layout_from_counts(
        case["vit"], case["llm"], case.get("vit_recompute"), case.get("llm_recompute"),
        spec.vit.num_layers, spec.llm.num_layers,
    )  # fmt: skip
    overrides = {"sequence_parallel": case.get("sequence_parallel", False)}
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), case["pp"]
    return vlm_model_provider(
        spec, layouts, pp_rank == 0, pp_rank == pp - 1, config_overrides=overrides, lora=lora,
        seed=seed,
    )  # fmt: skip


def reference_weights(spec: ModelSpec, lora: LoraSpec, seed: int) -> dict[str, torch.Tensor]:
    """Whole base weights (perturbed) and adapters with random A and B."""
    model = build(spec, {"tp": 1, "pp": 1, "vit": [spec.vit.num_layers],
                         "llm": [spec.llm.num_layers]}, seed, None)  # fmt: skip
    g = torch.Generator().manual_seed(seed + 1)
    out = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g)
           for n, p in sorted(global_named_parameters(model).items())}  # fmt: skip
    for name, layer in lora_layers(spec, lora).items():
        out[f"{name}.lora_a"] = 0.2 * torch.randn(lora.rank, layer.in_features, generator=g)
        out[f"{name}.lora_b"] = 0.2 * torch.randn(layer.out_features, lora.rank, generator=g)
    return out


def merged(weights: dict[str, torch.Tensor], spec: ModelSpec, lora: LoraSpec) -> dict:
    out = {n: w for n, w in weights.items() if not n.endswith((".lora_a", ".lora_b"))}
    for name in lora_layers(spec, lora):
        out[f"{name}.weight"] = merged_weight(
            weights[f"{name}.weight"], weights[f"{name}.lora_a"], weights[f"{name}.lora_b"],
            lora.scale,
        )  # fmt: skip
    return out


def _sum_sequence_parallel_grads(named: dict) -> None:
    """What finalize_model_grads does for parameters marked sequence_parallel."""
    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    for p in named.values():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def run_case(spec, case, weights, batches, seed, base_lora, out: Path) -> None:
    lora = None if case.get("lora") is False else LoraSpec.from_dict(
        {**base_lora.to_dict(), **case.get("lora", {})})  # fmt: skip
    model = build(spec, case, seed, lora)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    named = global_named_parameters(model)
    built = {n: gather(p.detach().clone(), p, n, spec) for n, p in named.items()
             if n.endswith((".lora_a", ".lora_b"))}  # fmt: skip
    source = weights if lora is not None else merged(weights, spec, base_lora)
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(shard(n, source[n], spec, tp, tp_rank))
    model.train()
    model_parallel_cuda_manual_seed(seed + 7)
    torch.manual_seed(seed + 7)
    losses = run_schedule(forward_step, model, batches)
    _sum_sequence_parallel_grads(named)
    grads, whole = {}, {}
    for n, p in named.items():
        whole[n] = gather(p.detach(), p, n, spec)
        if p.requires_grad:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads[n] = gather(g.detach(), p, n, spec)
        else:
            assert p.grad is None, n
    merges = {}
    if lora is not None:
        for name in lora_layers(spec, lora):
            if f"{name}.lora_a" in whole:
                merges[name] = merged_weight(whole[f"{name}.weight"], whole[f"{name}.lora_a"],
                                             whole[f"{name}.lora_b"], lora.scale)  # fmt: skip
    if ps.get_data_parallel_rank() == 0 and tp_rank == 0:
        result = {
            "losses": [x["lm loss"].tolist() for x in losses] if losses else [],
            "grads": grads,
            "trainable": sorted(n for n, p in named.items() if p.requires_grad),
            "merged": merges,
            "built": built,
        }
        torch.save(result, out / f"{case['name']}.stage{ps.get_pipeline_model_parallel_rank()}.pt")


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    spec = ModelSpec.from_dict(cfg["spec"])
    seed, lora = cfg["seed"], LoraSpec.from_dict(cfg["lora"])
    records = [r for mb in cfg["batches"] for r in mb]
    lengths = from_arrays([r[0] for r in records], [r[1] for r in records], [r[2] for r in records])
    batches, i = [], 0
    for mb in cfg["batches"]:
        batches.append(collate([synthetic_sample(i + k, lengths, spec, seed)
                                for k in range(len(mb))]))  # fmt: skip
        i += len(mb)
    weights = reference_weights(spec, lora, seed)
    assert all(unshard(n, [w], spec).shape == w.shape for n, w in weights.items())
    run_cases(cfg["cases"], lambda case: run_case(spec, case, weights, batches, seed, lora, out))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
