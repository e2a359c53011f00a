"""`omnibal stats`: length statistics (tiles, tokens) of a real VLM dataset, for balancing."""

from __future__ import annotations

import argparse
import os
import sys

HELP = "compute per-sample length statistics (image tiles, tokens) of a VLM dataset"

# Model presets: the vision tiling and the text side each model family uses.
PRESETS = {
    "internvl": dict(mode="dynamic", tile=448, max_tiles=12, tokens_per_tile=256,
                     template="internvl2_5", style="internvl"),
    "llava15": dict(mode="fixed", tile=336, max_tiles=1, tokens_per_tile=576,
                    template="vicuna_v1", style="llava"),
    "llava_next": dict(mode="anyres", tile=336, max_tiles=1, tokens_per_tile=576,
                       template="vicuna_v1", style="llava"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", help="LLaVA-style JSON list, JSONL, or InternVL meta JSON")
    parser.add_argument("--tokenizer", required=True,
                        help="local tokenizer: a Hugging Face directory or a tokenizer.json")
    parser.add_argument("--out", required=True,
                        help="length file (.json/.jsonl/.npz); for a meta input the meta .json")
    parser.add_argument("--model", choices=sorted(PRESETS), default="internvl",
                        help="preset for tiling, tokens per tile and template (default internvl)")
    parser.add_argument("--template", choices=["internvl2_5", "vicuna_v1", "hf"],
                        help="chat template; 'hf' uses the tokenizer's own chat template")
    parser.add_argument("--system-prompt", default=None,
                        help="system message (default: the template's own)")
    parser.add_argument("--tile-size", type=int, help="tile side in pixels (448 / 336)")
    parser.add_argument("--min-tiles", type=int, default=1, help="InternVL min_dynamic_patch")
    parser.add_argument("--max-tiles", type=int,
                        help="InternVL max_dynamic_patch (default 12; a meta entry's "
                             "max_dynamic_patch overrides it)")
    parser.add_argument("--no-thumbnail", action="store_true",
                        help="InternVL without the thumbnail tile (use_thumbnail=False)")
    parser.add_argument("--tokens-per-tile", type=int,
                        help="LLM tokens per tile (256 InternVL, 576 CLIP-L/336)")
    parser.add_argument("--pinpoints", default=None,
                        help="LLaVA-NeXT grid resolutions as HxW list, e.g. 336x672,672x336")
    parser.add_argument("--no-dummy-tile", action="store_true",
                        help="text-only samples get vit_num 0 instead of one blank tile")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="samples with more tokens are errors (or skipped)")
    parser.add_argument("--on-error", choices=["error", "skip"], default="error",
                        help="bad sample: stop (default) or leave it out and list it in the "
                             "skipped report")
    parser.add_argument("--skipped", default=None,
                        help="skipped report path (default: <out stem>.skipped.json)")
    parser.add_argument("--format", choices=["json", "jsonl", "npz"], default="json",
                        help="per-dataset file format for a meta input (default json)")
    parser.add_argument("--image-root", default=None,
                        help="image folder of a JSON/JSONL input (default: its folder)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="worker processes (default: all cores)")
    parser.add_argument("--chunk-size", type=int, default=256, help="samples per work item")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _pinpoints(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = [p.lower().split("x") for p in text.split(",") if p.strip()]
        return tuple((int(h), int(w)) for h, w in pairs)
    except ValueError as exc:
        raise ValueError(f"--pinpoints: expected HxW[,HxW...], got {text!r}") from exc


def build_config(args: argparse.Namespace):
    """The StatsConfig of the chosen preset with the flags given on top."""
    from megatron_omnibal.data import conversations as conv
    from megatron_omnibal.data.stats import StatsConfig
    from megatron_omnibal.data.tiling import DEFAULT_PINPOINTS, TilingConfig

    preset = PRESETS[args.model]
    tiling = TilingConfig(
        mode=preset["mode"],
        tile=args.tile_size or preset["tile"],
        min_tiles=args.min_tiles,
        max_tiles=args.max_tiles or preset["max_tiles"],
        thumbnail=not args.no_thumbnail,
        tokens_per_tile=args.tokens_per_tile or preset["tokens_per_tile"],
        pinpoints=_pinpoints(args.pinpoints) if args.pinpoints else DEFAULT_PINPOINTS,
        features_per_side=round((args.tokens_per_tile or preset["tokens_per_tile"]) ** 0.5),
    )
    style = conv.INTERNVL_IMAGE if preset["style"] == "internvl" else conv.LLAVA_IMAGE
    return StatsConfig(tokenizer=args.tokenizer, tiling=tiling,
                       template=args.template or preset["template"], image_style=style,
                       system=args.system_prompt, dummy_tile=not args.no_dummy_tile,
                       max_tokens=args.max_tokens)


def run(args: argparse.Namespace) -> int:
    from megatron_omnibal.data.stats import StatsError, compute_stats, write_outputs

    if args.workers < 1 or args.chunk_size < 1:
        raise ValueError("--workers and --chunk-size must be at least 1")
    config = build_config(args)
    try:
        result = compute_stats(args.dataset, config, image_root=args.image_root,
                               on_error=args.on_error, workers=args.workers,
                               chunk_size=args.chunk_size, progress=not args.no_progress)
    except StatsError as exc:
        print(f"omnibal stats: error: {exc}", file=sys.stderr)
        return 1
    written = write_outputs(result, args.out, args.format, args.skipped)
    stats = result.stats
    n = sum(result.records)
    rate = n / result.seconds if result.seconds > 0 else float("inf")
    if result.added_tokens:
        print(f"note: added {', '.join(result.added_tokens)} to the tokenizer as special tokens "
              "(as the model's training script does)", file=sys.stderr)
    print(f"{n} samples in {len(result.specs)} dataset(s), {len(result.skipped)} skipped, "
          f"{len(stats)} length entries; {result.seconds:.1f} s ({rate:.0f} samples/s, "
          f"{args.workers} worker(s))", file=sys.stderr)
    if len(stats):
        print(f"tiles: total {int(stats.vit.sum())}, max {int(stats.vit.max())}; tokens: mean "
              f"{stats.tokens.mean():.0f}, max {int(stats.tokens.max())}", file=sys.stderr)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0
