"""`omnibal profile`: time real megatron-core layers on this device -> layer profile JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_omnibal.cli_args import output_file, positive_float, positive_int

HELP = "measure real megatron-core ViT/LLM layers (forward/backward/recompute, memory)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="preset or JSON/YAML model file")
    parser.add_argument("--tiles", type=positive_int, default=4, help="image tiles per micro-batch")
    parser.add_argument(
        "--tokens", type=positive_int, default=256, help="LLM tokens per micro-batch"
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs (median)")
    parser.add_argument("--dp", type=positive_int, default=1, help="DP size for optimizer sharding")
    parser.add_argument(
        "--micro-batches",
        type=positive_int,
        default=8,
        help="micro-batches per step written into the profile",
    )
    parser.add_argument("--memory-gib", type=positive_float, help="per-GPU budget written into it")
    parser.add_argument("--out", type=output_file, default="profile.json")


def run(args: argparse.Namespace) -> int:
    from megatron_omnibal.megatron.profiling.profile import profile_model
    from megatron_omnibal.models.resolve import resolve_model

    doc = profile_model(
        resolve_model(args.model),
        args.tiles,
        args.tokens,
        args.repeats,
        args.dp,
        args.micro_batches,
        args.memory_gib,
    )
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    m = doc["measured"]
    first_llm = next(x for x in doc["layers"] if x["name"] == "llm.0")
    print(
        f"{m['model']} on {m['device']} ({m['dtype']}): ViT layer "
        f"{doc['layers'][1]['forward_ms']:.2f}/{doc['layers'][1]['backward_ms']:.2f} ms, "
        f"LLM layer {first_llm['forward_ms']:.2f}/{first_llm['backward_ms']:.2f} ms "
        f"(fwd/bwd, {m['tiles']} tiles, {m['tokens']} tokens); wrote {args.out}"
    )
    return 0
