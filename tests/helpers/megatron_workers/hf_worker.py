"""torchrun worker: load Hugging Face checkpoints into the VLM stages at several TP/PP layouts
and save what each layout computes (logits, ViT features, LLM final hidden states) and the
RoPE frequencies the head's stage built.

Usage: torchrun --nproc-per-node N hf_worker.py CASES.json OUT_DIR
CASES.json: {"models": {name: {"hf_dir": path, "batch": path to a torch-saved list of samples
             (tokens, images, image_flags), "cases"?: the case names this model runs (default
             all)}}, "cases": [{"name", "tp", "pp", "ep"?, "vit", "llm", "sequence_parallel"?}]}
(`ep`: expert-parallel ranks of a mixture-of-experts LLM; the world is TP x PP x EP)
Weights go through the package's own path: models.hf_weights (HF -> canonical tensors) and
megatron.stage_weights / tp_shard (canonical -> this rank's piece). The test compares the saved
outputs with transformers' forward on the same inputs.
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
from parallel_groups import reset_model_parallel  # noqa: E402

from megatron_omnibal.megatron.checkpoint.stage_runtime import (  # noqa: E402
    build_stage,
    forward_outputs,
    init_parallel,
)
from megatron_omnibal.megatron.checkpoint.stage_weights import load_into  # noqa: E402
from megatron_omnibal.megatron.stages.layout import layout_from_counts  # noqa: E402
from megatron_omnibal.megatron.stream.batch import Sample, collate  # noqa: E402
from megatron_omnibal.models.hf_config import read_hf  # noqa: E402
from megatron_omnibal.models.hf_weights import SafetensorsReader, canonical_tensors  # noqa: E402


def run(name: str, spec, tensors: dict, batch, case: dict, out: Path) -> None:
    layouts = layout_from_counts(
        case["vit"], case["llm"], vit_layers=spec.vit.num_layers, llm_layers=spec.llm.num_layers
    )
    reset_model_parallel()
    init_parallel(layouts, case["tp"], case.get("ep", 1))
    model = build_stage(spec, layouts, bool(case.get("sequence_parallel")))
    tp_rank = ps.get_tensor_model_parallel_rank()
    load_into(model, spec, tensors, case["tp"], tp_rank)
    kept = forward_outputs(model, batch, spec.llm.vocab_size)
    if model.output_layer is not None:  # RoPE frequencies as built (base, Llama-3 scaling)
        kept["rope_inv_freq"] = model.rotary.inv_freq
    if ps.get_data_parallel_rank() == 0 and tp_rank == 0:
        stage = ps.get_pipeline_model_parallel_rank()
        torch.save(kept, out / f"{name}.{case['name']}.stage{stage}.pt")


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    for name, m in cfg["models"].items():
        hf = read_hf(m["hf_dir"])
        tensors = dict(canonical_tensors(hf, SafetensorsReader(hf)))
        samples = [Sample(**s) for s in torch.load(m["batch"])]
        batch = collate(samples)
        for case in cfg["cases"]:
            if case["name"] in m.get("cases", [case["name"]]):
                run(name, hf.spec, tensors, batch, case, out)
                dist.barrier()
        if dist.get_rank() == 0:
            print(f"{name} done", flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
