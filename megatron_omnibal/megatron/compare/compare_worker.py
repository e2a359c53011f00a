"""The rank program of `omnibal compare-hf`: this rank's stage of a Megatron checkpoint at a
layout, one forward pass of the probe samples, its outputs saved for the comparison.

python -m megatron_omnibal.megatron.runtime.local_ranks --nproc-per-node N
-m megatron_omnibal.megatron.compare.compare_worker
--ckpt ITERATION_DIR --format torch|torch_dist --spec JSON --tp T [--ep E] --ckpt-pp P
--stages JSON
[--sequence-parallel] [--lora JSON [--base-hf DIR]] --samples FILE --out DIR
(--lora: the stages get the checkpoint's LoRA adapters; --base-hf: an adapter-only checkpoint's
base weights, from that HF checkpoint)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="compare_worker")
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--format", choices=("torch", "torch_dist"), required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--ckpt-pp", type=int, required=True)
    parser.add_argument("--stages", required=True)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--lora", default=None)
    parser.add_argument("--base-hf", type=Path, default=None)
    parser.add_argument("--samples", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron

    enable_cpu_megatron()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_omnibal.megatron.checkpoint.stage_runtime import (
        build_stage,
        forward_outputs,
        init_parallel,
        load_hf_base,
        load_megatron_checkpoint,
    )
    from megatron_omnibal.megatron.stages.layout import layout_from_dicts
    from megatron_omnibal.megatron.stream.batch import Sample, collate
    from megatron_omnibal.models.lora import LoraSpec
    from megatron_omnibal.models.spec import ModelSpec

    dist.init_process_group("gloo")
    spec = ModelSpec.from_dict(json.loads(args.spec))
    layouts = layout_from_dicts(
        json.loads(args.stages), spec.vit.num_layers, spec.llm.num_layers, "--stages"
    )
    init_parallel(layouts, args.tp, args.ep)
    lora = None if args.lora is None else LoraSpec.from_dict(json.loads(args.lora))
    model = build_stage(spec, layouts, args.sequence_parallel, lora)
    if args.base_hf is not None:
        load_hf_base(model, args.base_hf)
    load_megatron_checkpoint(model, args.ckpt, args.format, args.ckpt_pp,
                             adapters_only=args.base_hf is not None)  # fmt: skip
    model.float()
    samples = [Sample(**s) for s in torch.load(args.samples)]
    outputs = forward_outputs(model, collate(samples), spec.llm.vocab_size)
    if ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0:
        torch.save(outputs, args.out / f"stage{ps.get_pipeline_model_parallel_rank()}.pt")
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
