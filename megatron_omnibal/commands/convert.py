"""`omnibal convert`: Hugging Face checkpoints into Megatron checkpoints of the VLM stages at a
TP/PP layout, and trained Megatron checkpoints back into Hugging Face checkpoints."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from megatron_omnibal.cli_args import counts, non_negative_int, output_dir, positive_int

HELP = "convert HF VLM checkpoints to Megatron checkpoints (any TP/PP/EP) and back"

DTYPES = ("bf16", "fp16", "fp32")


def _size(text: str) -> int:
    """'5GB', '500MB', '1024' (bytes) -> bytes."""
    units = {"KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
    t = text.strip().upper()
    for unit, mult in units.items():
        if t.endswith(unit):
            try:
                value = float(t[: -len(unit)]) * mult
            except ValueError:
                break
            if math.isfinite(value) and value >= 1:
                return int(value)
    if t.isdigit() and int(t) > 0:
        return int(t)
    raise argparse.ArgumentTypeError(f"expected a size like 5GB or 500MB, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="direction", required=True, metavar="DIRECTION")
    to_meg = sub.add_parser(
        "hf-to-megatron",
        help="HF checkpoint -> Megatron checkpoint for a TP/PP/EP layout",
        description="Write a Megatron checkpoint of the VLM stages that pretrain_vlm starts "
        "from with --pretrained-checkpoint (or --load DIR --finetune --no-load-optim "
        "--no-load-rng). The layout comes from a plan or from the flags.",
    )
    to_meg.add_argument("hf_dir", type=Path, help="HF checkpoint directory (config.json, "
                        "safetensors)")  # fmt: skip
    to_meg.add_argument("--out", type=output_dir, required=True,
                        help="checkpoint directory to create")  # fmt: skip
    to_meg.add_argument("--plan", type=Path, help="plan.json from `omnibal plan` (layout, TP)")
    to_meg.add_argument("--tp", type=positive_int, help="tensor parallel size (without --plan)")
    to_meg.add_argument("--pp", type=positive_int, help="pipeline stages (without --plan)")
    to_meg.add_argument("--ep", type=positive_int,
                        help="expert parallel size of a mixture-of-experts LLM (without --plan; "
                        "default 1): torch-format files per expert-parallel rank; torch_dist "
                        "loads at any EP")  # fmt: skip
    to_meg.add_argument("--omnibal-vit-pp-layers", type=counts, metavar="N,N,..",
                        help="ViT layers per stage (without --plan)")  # fmt: skip
    to_meg.add_argument("--omnibal-llm-pp-layers", type=counts, metavar="N,N,..",
                        help="LLM layers per stage (without --plan)")  # fmt: skip
    to_meg.add_argument("--ckpt-format", choices=("torch", "torch_dist"), default="torch",
                        help="Megatron checkpoint format (torch_dist: written by Megatron itself "
                             "in TP x PP x EP local processes)")  # fmt: skip
    to_meg.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as stored)")
    to_meg.add_argument("--force", action="store_true", help="write into an existing --out")
    to_meg.add_argument("--no-progress", action="store_true", help="no progress bar")
    to_hf = sub.add_parser(
        "megatron-to-hf",
        help="Megatron checkpoint -> HF checkpoint shaped like the original",
        description="Write safetensors (sharded as transformers does), the config and the "
        "tokenizer/processor files of --like, so that transformers loads the result.",
    )
    to_hf.add_argument("ckpt_dir", type=Path, help="Megatron checkpoint directory")
    to_hf.add_argument("--like", type=Path, required=True,
                       help="the HF checkpoint the model came from")  # fmt: skip
    to_hf.add_argument("--out", type=output_dir, required=True, help="HF directory to create")
    to_hf.add_argument("--iteration", type=non_negative_int,
                       help="iteration to export (default: latest)")  # fmt: skip
    to_hf.add_argument("--dtype", choices=DTYPES, help="cast (default: --like's dtypes)")
    to_hf.add_argument("--max-shard-size", type=_size, default=5 * 2**30,
                       help="largest safetensors shard (default 5GB)")  # fmt: skip
    to_hf.add_argument("--force", action="store_true", help="write into an existing --out")
    to_hf.add_argument("--no-progress", action="store_true", help="no progress bar")
    to_hf.add_argument("--adapter-out", type=output_dir, default=None,
                       help="LoRA checkpoints: the PEFT adapter directory (adapter_config.json, "
                       "adapter_model.safetensors; default: OUT-adapter); --out gets the "
                       "merged model")  # fmt: skip


def _out_dir(path: Path, force: bool) -> None:
    """Create `path` before any work; refuse a non-empty one without --force."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path}: exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise ValueError(f"--out {path}: not empty (use --force to write into it)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out {path}: cannot create ({exc.strerror})") from exc


def _dtype(name: str | None):
    import torch

    return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        name
    ]


def _layouts(args: argparse.Namespace, spec) -> tuple[list, int, int, int]:
    """(the stages, or a plan's virtual stages; TP; PP; EP)."""
    from megatron_omnibal.megatron.stages.configs import check_tensor_parallel
    from megatron_omnibal.megatron.stages.layout import layout_from_counts, layout_from_plan
    from megatron_omnibal.models.spec import check_expert_parallel
    from megatron_omnibal.planner.plan_file.plan import load_plan

    flags = (args.tp, args.pp, args.ep, args.omnibal_vit_pp_layers, args.omnibal_llm_pp_layers)
    if args.plan is not None:
        if any(f is not None for f in flags):
            raise ValueError(
                "give --plan or the layout flags (--tp --pp --ep --omnibal-*-pp-layers)"
            )
        plan = load_plan(args.plan)
        if plan.model_spec != spec:
            raise ValueError(
                f"--plan {args.plan} was made for another model than {args.hf_dir} "
                "(their model specs differ; plan with `omnibal plan --model HF_DIR`)"
            )
        tp, pp, ep = plan.parallel.tp, plan.parallel.pp, plan.parallel.ep
        layouts = layout_from_plan(plan, pp)
    else:
        if args.omnibal_vit_pp_layers is None or args.omnibal_llm_pp_layers is None:
            raise ValueError(
                "give --plan, or --omnibal-vit-pp-layers and --omnibal-llm-pp-layers (with --tp)"
            )
        tp, ep = args.tp or 1, args.ep or 1
        layouts = layout_from_counts(
            args.omnibal_vit_pp_layers,
            args.omnibal_llm_pp_layers,
            vit_layers=spec.vit.num_layers,
            llm_layers=spec.llm.num_layers,
        )
        if args.pp is not None and args.pp != len(layouts):
            raise ValueError(
                f"--pp {args.pp} but --omnibal-vit-pp-layers lists {len(layouts)} stages"
            )
        pp = len(layouts)
    check_tensor_parallel(spec, tp)
    try:
        check_expert_parallel(spec, ep)
    except ValueError as exc:
        raise ValueError(f"--ep: {exc}") from None
    return layouts, tp, pp, ep


def _bar(total: int, desc: str, off: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=off or None, file=sys.stderr)


def _hf_to_megatron(args: argparse.Namespace) -> int:
    from megatron_omnibal.models.hf_config import read_hf
    from megatron_omnibal.models.hf_weights import canonical_shapes

    hf = read_hf(args.hf_dir)
    layouts, tp, pp, ep = _layouts(args, hf.spec)
    _out_dir(args.out, args.force)
    total = len(canonical_shapes(hf)) + int(hf.spec.llm.tie_embeddings)
    with _bar(total, "convert", args.no_progress) as bar:
        if args.ckpt_format == "torch":
            from megatron_omnibal.megatron.checkpoint.hf_checkpoint import write_torch_checkpoint

            written = write_torch_checkpoint(
                hf, layouts, tp, args.out, _dtype(args.dtype), bar.update, pp, ep
            )
        else:
            from megatron_omnibal.megatron.checkpoint.dist_convert import write_dist_checkpoint

            written = write_dist_checkpoint(hf, layouts, tp, args.out, args.dtype, ep)
            bar.update(total)
    stages = " | ".join(
        f"vit {st.vit_layers[0]}-{st.vit_layers[1]} llm {st.llm_layers[0]}-{st.llm_layers[1]}"
        for st in layouts
    )
    chunks = f" x {len(layouts) // pp} chunks" if len(layouts) > pp else ""
    print(
        f"wrote {args.out} ({args.ckpt_format}, TP {tp} x PP {pp}{chunks}"
        f"{f' x EP {ep}' if ep > 1 else ''}: {stages}; "
        f"{len(written)} files)"
    )
    return 0


def _megatron_to_hf(args: argparse.Namespace) -> int:
    from megatron_omnibal.megatron.checkpoint.checkpoint_reader import (
        canonical_groups,
        open_checkpoint,
    )
    from megatron_omnibal.models.hf_config import read_hf
    from megatron_omnibal.models.hf_export import export_hf
    from megatron_omnibal.models.hf_weights import canonical_shapes

    like = read_hf(args.like)
    ckpt = open_checkpoint(args.ckpt_dir, args.iteration)
    if ckpt.spec != like.spec:
        raise ValueError(
            f"{args.ckpt_dir} holds another model than --like {args.like} (model specs differ)"
        )
    _out_dir(args.out, args.force)
    if ckpt.lora is not None:
        return _export_lora(args, ckpt, like)
    if args.adapter_out is not None:
        raise ValueError(f"--adapter-out: {ckpt.path} holds no LoRA adapters")
    with _bar(len(canonical_shapes(like)), "export", args.no_progress) as bar:
        shards = export_hf(
            canonical_groups(ckpt), like, args.out, _dtype(args.dtype), args.max_shard_size,
            bar.update,
        )  # fmt: skip
    print(f"wrote {args.out} from {ckpt.path} ({len(shards)} safetensors shard(s))")
    return 0


def _export_lora(args: argparse.Namespace, ckpt, like) -> int:
    """A LoRA checkpoint: the merged model into --out (base weights of an adapter-only
    checkpoint from --like, the model the run started from) and the PEFT adapter into
    --adapter-out (the parts trained in full as its modules_to_save; none where PEFT cannot
    hold the run: the merged model then holds it all)."""
    from megatron_omnibal.megatron.checkpoint.checkpoint_reader import canonical_groups
    from megatron_omnibal.models.hf_export import export_hf
    from megatron_omnibal.models.hf_weights import (
        SafetensorsReader,
        canonical_shapes,
        canonical_tensors,
    )
    from megatron_omnibal.models.lora import is_adapter, peft_refusal
    from megatron_omnibal.models.lora_export import (
        merge_groups,
        trained_part,
        with_base,
        write_peft_adapter,
    )

    lora = ckpt.lora
    refusal = peft_refusal(lora)
    adapter_out = None
    if refusal is None:
        adapter_out = args.adapter_out or args.out.with_name(args.out.name + "-adapter")
        _out_dir(adapter_out, args.force)
    elif args.adapter_out is not None:
        raise ValueError(f"--adapter-out: {ckpt.path}: {refusal}")
    adapters: dict = {}
    trained: dict = {}

    def keep_adapters(groups):
        for group in groups:
            for name, tensor in group.items():
                if is_adapter(name):
                    adapters[name] = tensor
                elif trained_part(name) in lora.train:
                    trained[name] = tensor
            yield group

    groups = keep_adapters(canonical_groups(ckpt))
    if ckpt.adapters_only:
        groups = with_base(groups, canonical_tensors(like, SafetensorsReader(like)))
    with _bar(len(canonical_shapes(like)), "export", args.no_progress) as bar:
        shards = export_hf(
            merge_groups(groups, ckpt.spec, lora), like, args.out, _dtype(args.dtype),
            args.max_shard_size, bar.update,
        )  # fmt: skip
    written = f"wrote {args.out} (merged: W + {lora.alpha:g}/{lora.rank} B A) from {ckpt.path} " \
        f"({len(shards)} safetensors shard(s))"
    if adapter_out is None:
        print(f"{written}; no PEFT adapter: {refusal}")
        return 0
    modules = write_peft_adapter(adapters, like, lora, adapter_out, _dtype(args.dtype), trained)
    print(f"{written} and the PEFT adapter {adapter_out} ({len(modules)} modules)")
    return 0


def run(args: argparse.Namespace) -> int:
    args.out = Path(args.out)
    if getattr(args, "adapter_out", None) is not None:
        args.adapter_out = Path(args.adapter_out)
    if args.direction == "hf-to-megatron":
        return _hf_to_megatron(args)
    return _megatron_to_hf(args)
