"""HF checkpoint -> Megatron `torch_dist` checkpoint, written by megatron-core itself.

Why processes: a torch_dist checkpoint holds global tensors under the keys of the modules'
sharded state dicts (a tower's layers stacked, tied heads, padded vocabularies), which only the
built modules know. So TP x PP x EP local CPU processes (forked by
megatron/runtime/local_ranks.py; gloo; GPUs hidden) each build their stage, fill it from the HF
tensors of that stage alone and save with megatron-core's dist_checkpointing, as
megatron.training does. Each process holds one TP x PP shard and its EP rank's experts
(megatron-core stores every expert at its global index: the checkpoint loads at any EP).

Run by `omnibal convert hf-to-megatron --ckpt-format torch_dist`; the module's main() is the
worker (under torchrun, or as run here): python -m megatron_omnibal.megatron.runtime.local_ranks
--nproc-per-node N -m megatron_omnibal.megatron.checkpoint.dist_convert
--hf DIR --out DIR --tp T [--ep E] --stages JSON [--dtype bf16|fp16|fp32]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_omnibal.megatron.runtime import local_ranks
from megatron_omnibal.models.hf_config import HFModel
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout

CHECKPOINT_VERSION = 3.0


def write_dist_checkpoint(
    hf: HFModel, layouts: Sequence[StageLayout], tp: int, out: Path, dtype: str | None,
    ep: int = 1,
) -> list[Path]:
    """Run the TP x PP x EP worker processes; returns the files written."""
    stages = json.dumps([st.to_dict() for st in layouts])
    program = ["-m", "megatron_omnibal.megatron.checkpoint.dist_convert", "--hf", str(hf.path),
               "--out", str(out), "--tp", str(tp), "--ep", str(ep), "--stages", stages]
    if dtype:
        program += ["--dtype", dtype]
    proc = local_ranks.run(tp * len(layouts) * ep, program)
    if proc.returncode:
        lines = [ln for ln in proc.stderr.splitlines() if "Error" in ln or "error" in ln]
        raise RuntimeError(
            "torch_dist conversion failed in its worker processes:\n"
            + "\n".join(lines[-5:] or proc.stderr.splitlines()[-20:])
        )
    return sorted(p for p in out.rglob("*") if p.is_file())


def _worker(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(prog="dist_convert")
    parser.add_argument("--hf", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--stages", required=True)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"))
    args = parser.parse_args(argv)

    from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron

    enable_cpu_megatron()
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_omnibal.megatron.checkpoint.hf_checkpoint import MODEL_FILE, TRACKER
    from megatron_omnibal.megatron.checkpoint.stage_runtime import build_stage, init_parallel
    from megatron_omnibal.megatron.checkpoint.stage_weights import load_into, source, stage_names
    from megatron_omnibal.megatron.stages.layout import layout_from_dicts
    from megatron_omnibal.models.hf_config import read_hf
    from megatron_omnibal.models.hf_weights import SafetensorsReader, canonical_tensors, rules_for

    dist.init_process_group("gloo")
    hf = read_hf(args.hf)
    spec = hf.spec
    layouts = layout_from_dicts(
        json.loads(args.stages), spec.vit.num_layers, spec.llm.num_layers, "--stages"
    )
    init_parallel(layouts, args.tp, args.ep)
    model = build_stage(spec, layouts)
    layout = layouts[ps.get_pipeline_model_parallel_rank()]
    names = stage_names(spec, layout, [r.canonical for r in rules_for(hf)])
    wanted = {source(n, spec) for n in names}
    tensors = dict(canonical_tensors(hf, SafetensorsReader(hf), wanted.__contains__))
    load_into(model, spec, tensors, args.tp, ps.get_tensor_model_parallel_rank())
    del tensors
    if args.dtype:
        model.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype])
    saved_args = argparse.Namespace(
        tensor_model_parallel_size=args.tp,
        pipeline_model_parallel_size=len(layouts),
        expert_model_parallel_size=args.ep,
        omnibal_model_spec=json.dumps(spec.to_dict()),
        omnibal_stages=args.stages,
    )
    metadata = {
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }
    state = {
        "model": model.sharded_state_dict(metadata=metadata),
        "args": saved_args,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0,
    }
    release = args.out / "release"
    release.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(
        state,
        str(release),
        content_metadata={k: v for k, v in metadata.items() if k != "dp_cp_group"},
    )
    if dist.get_rank() == 0:
        (args.out / TRACKER).write_text("release")
        record = {
            "model_spec": spec.to_dict(),
            "tensor_parallel": args.tp,
            "expert_parallel": args.ep,
            "stages": json.loads(args.stages),
            "hf_source": str(hf.path),
            "family": hf.family,
            "llm_arch": hf.llm_arch,
        }
        (args.out / MODEL_FILE).write_text(json.dumps(record, indent=2))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1:])
