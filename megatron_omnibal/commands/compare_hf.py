"""`omnibal compare-hf`: transformers' forward of an HF checkpoint against the Megatron stages
of a checkpoint, on the same images and text; JSON differences, non-zero exit above tolerance."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from megatron_omnibal.cli_args import counts, non_negative_int, positive_float, positive_int
from megatron_omnibal.megatron.runtime import local_ranks

HELP = "check a Megatron checkpoint's logits against transformers' forward of an HF checkpoint"


def _tolerance(text: str) -> float:
    value = positive_float(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("hf_dir", type=Path, help="HF checkpoint directory (transformers format)")
    parser.add_argument("ckpt_dir", type=Path, help="Megatron checkpoint directory")
    parser.add_argument("--iteration", type=non_negative_int,
                        help="checkpoint iteration (default: latest)")  # fmt: skip
    parser.add_argument("--tp", type=positive_int, help="TP to run at (default: the checkpoint's)")
    parser.add_argument("--ep", type=positive_int,
                        help="expert parallel size to run a mixture-of-experts LLM at "
                        "(default: the checkpoint's; another only for torch_dist)")  # fmt: skip
    parser.add_argument("--omnibal-vit-pp-layers", type=counts, metavar="N,N,..",
                        help="ViT layers per stage to run at (torch_dist checkpoints)")  # fmt: skip
    parser.add_argument("--omnibal-llm-pp-layers", type=counts, metavar="N,N,..",
                        help="LLM layers per stage to run at (torch_dist checkpoints)")  # fmt: skip
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="run the LLM with sequence parallelism (TP > 1)")  # fmt: skip
    parser.add_argument("--tolerance", type=_tolerance, default=1e-4,
                        help="largest relative difference (default 1e-4, fp32)")  # fmt: skip
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the probe inputs")
    parser.add_argument("--adapter", type=Path, default=None,
                        help="a LoRA checkpoint's PEFT adapter directory: transformers runs "
                        "the base model with it through peft (the base: --base, else HF_DIR); "
                        "with --base, HF_DIR (the merged export) is checked too")  # fmt: skip
    parser.add_argument("--base", type=Path, default=None,
                        help="the HF base model a LoRA checkpoint trained on (the base "
                        "weights of an adapter-only checkpoint; default with --adapter: "
                        "HF_DIR)")  # fmt: skip


def _layout(args: argparse.Namespace, ckpt) -> tuple[list, int, int]:
    from megatron_omnibal.megatron.stages.configs import check_tensor_parallel, padded_heads
    from megatron_omnibal.megatron.stages.layout import layout_from_counts
    from megatron_omnibal.models.spec import check_expert_parallel

    spec = ckpt.spec
    counts = (args.omnibal_vit_pp_layers, args.omnibal_llm_pp_layers)
    if any(c is not None for c in counts):
        if None in counts:
            raise ValueError("give both --omnibal-vit-pp-layers and --omnibal-llm-pp-layers")
        layouts = layout_from_counts(
            *counts, vit_layers=spec.vit.num_layers, llm_layers=spec.llm.num_layers
        )
    else:
        layouts = list(ckpt.layouts)
    tp, ep = args.tp or ckpt.tp, args.ep or ckpt.ep
    check_tensor_parallel(spec, tp)
    try:
        check_expert_parallel(spec, ep)
    except ValueError as exc:
        raise ValueError(f"--ep: {exc}") from None
    heads = spec.vit.num_attention_heads
    if padded_heads(heads, tp) != padded_heads(heads, ckpt.tp):
        raise ValueError(
            f"--tp {tp}: the ViT's {heads} heads are padded to {padded_heads(heads, tp)} there, "
            f"the checkpoint (TP {ckpt.tp}) holds {padded_heads(heads, ckpt.tp)}; use a TP that "
            "pads them alike"
        )
    same = tp == ckpt.tp and ep == ckpt.ep and [(s.vit_layers, s.llm_layers) for s in layouts] == [
        (s.vit_layers, s.llm_layers) for s in ckpt.layouts
    ]
    if ckpt.format == "torch" and not same:
        raise ValueError(
            f"{ckpt.path} is a torch-format checkpoint: it loads only at its own layout "
            f"(TP {ckpt.tp}, PP {len(ckpt.layouts)}, EP {ckpt.ep} as written); a torch_dist "
            "checkpoint loads at any layout"
        )
    return layouts, tp, ep


def _difference(got, want) -> dict[str, float]:
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: Megatron {tuple(got.shape)}, HF {tuple(want.shape)}")
    diff = (got.float() - want.float()).abs().max()
    return {"max_abs": float(diff), "max_rel": float(diff / want.abs().max())}


def run(args: argparse.Namespace) -> int:
    import torch

    from megatron_omnibal.megatron.checkpoint.checkpoint_reader import open_checkpoint
    from megatron_omnibal.megatron.compare.probe import probe_samples
    from megatron_omnibal.models.hf_config import read_hf
    from megatron_omnibal.models.hf_reference import load_model, reference

    hf = read_hf(args.hf_dir)
    ckpt = open_checkpoint(args.ckpt_dir, args.iteration)
    if ckpt.spec != hf.spec:
        raise ValueError(f"{args.ckpt_dir} holds another model than {args.hf_dir}")
    layouts, tp, ep = _layout(args, ckpt)
    samples = probe_samples(hf.spec, args.seed)
    if args.adapter is not None and ckpt.lora is None:
        raise ValueError(f"--adapter: {args.ckpt_dir} holds no LoRA adapters")
    base = args.base or (args.hf_dir if args.adapter is not None else None)
    if ckpt.adapters_only and base is None:
        raise ValueError(
            f"{args.ckpt_dir} holds LoRA adapters only: give --base HF_DIR (the model it "
            "trained on) or --adapter with HF_DIR the base"
        )
    refs = {}  # report section: transformers' outputs
    if args.adapter is None or args.base is not None:
        refs["hf"] = reference(load_model(hf), hf, samples)
    if args.adapter is not None:
        from peft import PeftModel

        base_hf = read_hf(base)
        if base_hf.spec != hf.spec:
            raise ValueError(f"--base {base} is another model than {args.hf_dir}")
        peft_model = PeftModel.from_pretrained(load_model(base_hf), str(args.adapter))
        refs["adapter"] = reference(peft_model.base_model.model.eval(), base_hf, samples)
    with tempfile.TemporaryDirectory(prefix="omnibal-compare-") as tmp:
        work = Path(tmp)
        torch.save([asdict(s) for s in samples], work / "samples.pt")
        program = [
            "-m", "megatron_omnibal.megatron.compare.compare_worker", "--ckpt", str(ckpt.path),
            "--format", ckpt.format, "--spec", json.dumps(hf.spec.to_dict()), "--tp", str(tp),
            "--ep", str(ep),
            "--ckpt-pp", str(ckpt.pp), "--stages", json.dumps([st.to_dict() for st in layouts]),
            "--samples", str(work / "samples.pt"), "--out", str(work),
        ]  # fmt: skip
        if args.sequence_parallel:
            program.append("--sequence-parallel")
        if ckpt.lora is not None:
            program += ["--lora", json.dumps(ckpt.lora.to_dict())]
            if ckpt.adapters_only:
                program += ["--base-hf", str(base)]
        proc = local_ranks.run(tp * len(layouts) * ep, program)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-4000:])
            raise ValueError("the Megatron stages failed (their output is above)")
        got: dict[str, torch.Tensor] = {}
        for f in sorted(work.glob("stage*.pt")):
            got.update(torch.load(f))
    flags = torch.cat([s.image_flags for s in samples]).bool()
    vit = got["vit"] if hf.spec.vit.native_resolution else got["vit"][flags]  # native: patches
    sections = {
        name: {
            "logits": _difference(got["logits"], ref["logits"]),
            "vit": _difference(vit, ref["vit"]),
            "llm": _difference(got["llm"], ref["llm"]),
        }
        for name, ref in refs.items()
    }
    report = dict(sections.pop("hf", None) or sections.pop("adapter"))
    if sections:  # the merged export above, the base with the adapter here
        report["adapter"] = sections["adapter"]
    worst = max(v["max_rel"] for part in (report, report.get("adapter", {}))
                for k, v in part.items() if k in ("logits", "vit", "llm"))  # fmt: skip
    report.update(
        tolerance=args.tolerance,
        ok=worst <= args.tolerance,
        tp=tp,
        pp=len(layouts),
        ep=ep,
        vit_pp_layers=[st.num_vit_layers for st in layouts],
        llm_pp_layers=[st.num_llm_layers for st in layouts],
        sequence_parallel=args.sequence_parallel,
        checkpoint_format=ckpt.format,
        lora=None if ckpt.lora is None else ckpt.lora.to_dict(),
        adapter_dir=None if args.adapter is None else str(args.adapter),
    )
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1
