"""Checkpoint conversion: time and peak memory of `omnibal convert` on a generated model of a few
hundred MB, against the size of the whole model and of its largest pipeline stage.

Generates a random InternVL (InternViT-300M-like tower, a Qwen2-like LLM) with transformers,
saved in bf16 and sharded like a hub checkpoint, then runs, each as its own process (its peak
resident memory read from the OS):
- `omnibal convert hf-to-megatron` at PP=4 in the `torch` format (streamed stage by stage);
- `omnibal convert megatron-to-hf` of that checkpoint (streamed stage by stage);
- an idle process that imports what the converter imports, for the memory the libraries take.
The claim checked: the converter's memory beyond the libraries' is about one stage, not the
model.

Usage: OMP_NUM_THREADS=1 python bench/bench_convert.py [--json PATH] [--llm-layers 12]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
IMPORTS = (
    "import torch, transformers, safetensors, tqdm; "
    "import megatron_omnibal.models.hf_weights, "
    "megatron_omnibal.megatron.checkpoint.hf_checkpoint, "
    "megatron_omnibal.megatron.checkpoint.checkpoint_reader, megatron_omnibal.models.hf_export"
)


def generate(path: Path, llm_layers: int) -> None:
    """A random InternVL checkpoint: 8 ViT layers of 1024, `llm_layers` LLM layers of 1024."""
    import torch
    from transformers import InternVLConfig, InternVLForConditionalGeneration, Qwen2Config
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

    vision = InternVLVisionConfig(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, intermediate_size=4096,
        image_size=448, patch_size=14, attention_bias=True,
    )  # fmt: skip
    text = Qwen2Config(
        hidden_size=1024, num_hidden_layers=llm_layers, num_attention_heads=16,
        num_key_value_heads=4, intermediate_size=2816, vocab_size=16000,
        tie_word_embeddings=False,
    )  # fmt: skip
    cfg = InternVLConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                         image_token_id=15999, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(cfg).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100MB")


def peak_rss_mib(cmd: list[str]) -> tuple[float, float]:
    """(wall seconds, peak resident MiB) of a child process."""
    script = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
        "print(time.perf_counter() - t, "
        "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", script, *cmd], env=ENV, capture_output=True,
                         text=True, check=True)  # fmt: skip
    wall, rss = out.stdout.split()
    return float(wall), float(rss)


def sizes(hf_dir: Path, layouts) -> tuple[float, float]:
    """(whole model MiB, largest stage MiB) of the canonical tensors, from the spec's shapes."""
    from megatron_omnibal.megatron.checkpoint.stage_weights import owns
    from megatron_omnibal.models.hf_config import read_hf
    from megatron_omnibal.models.hf_weights import canonical_shapes

    hf = read_hf(hf_dir)
    shapes = canonical_shapes(hf)
    nbytes = {n: 2 * math.prod(s) for n, s in shapes.items()}  # bf16
    whole = sum(nbytes.values())
    stages = [sum(b for n, b in nbytes.items() if owns(n, st)) for st in layouts]
    return whole / 2**20, max(stages) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llm-layers", type=int, default=12)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    from megatron_omnibal.megatron.stages.layout import layout_from_counts

    vit, llm = [8, 0, 0, 0], [0] + [args.llm_layers // 3] * 2
    llm.append(args.llm_layers - sum(llm))
    layouts = layout_from_counts(vit, llm, vit_layers=8, llm_layers=args.llm_layers)
    with tempfile.TemporaryDirectory(prefix="bench_convert_") as tmp:
        root = Path(tmp)
        hf, ckpt, back = root / "hf", root / "megatron", root / "export"
        generate(hf, args.llm_layers)
        whole, stage = sizes(hf, layouts)
        omnibal = [sys.executable, "-m", "megatron_omnibal.cli", "convert"]
        _, idle = peak_rss_mib([sys.executable, "-c", IMPORTS])
        to_wall, to_rss = peak_rss_mib([
            *omnibal, "hf-to-megatron", str(hf), "--omnibal-vit-pp-layers",
            ",".join(map(str, vit)), "--omnibal-llm-pp-layers", ",".join(map(str, llm)),
            "--out", str(ckpt), "--no-progress",
        ])  # fmt: skip
        back_wall, back_rss = peak_rss_mib([*omnibal, "megatron-to-hf", str(ckpt), "--like",
                                            str(hf), "--out", str(back), "--no-progress"])
    report = {
        "model_mib": round(whole, 1),
        "largest_stage_mib": round(stage, 1),
        "pp": len(layouts),
        "vit_pp_layers": vit,
        "llm_pp_layers": llm,
        "libraries_rss_mib": round(idle, 1),
        "hf_to_megatron": {"seconds": round(to_wall, 2), "peak_rss_mib": round(to_rss, 1),
                           "beyond_libraries_mib": round(to_rss - idle, 1)},
        "megatron_to_hf": {"seconds": round(back_wall, 2), "peak_rss_mib": round(back_rss, 1),
                           "beyond_libraries_mib": round(back_rss - idle, 1)},
        "load_average": os.getloadavg(),
    }  # fmt: skip
    print(f"model {whole:.0f} MiB (bf16), PP=4, largest stage {stage:.0f} MiB; "
          f"the libraries alone take {idle:.0f} MiB")  # fmt: skip
    for key, label in (("hf_to_megatron", "hf-to-megatron"), ("megatron_to_hf", "megatron-to-hf")):
        r = report[key]
        print(f"{label:>15}: {r['seconds']:6.1f} s, peak {r['peak_rss_mib']:.0f} MiB = libraries "
              f"+ {r['beyond_libraries_mib']:.0f} MiB ({r['beyond_libraries_mib'] / stage:.2f}x "
              f"the largest stage, {r['beyond_libraries_mib'] / whole:.2f}x the model)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
