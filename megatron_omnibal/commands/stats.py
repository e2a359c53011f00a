"""`omnibal stats`: length statistics (tiles, tokens) of a real VLM dataset, for balancing."""

from __future__ import annotations

import argparse
import os
import sys

from megatron_omnibal.cli_args import output_file_type, positive_float, positive_int
from megatron_omnibal.data.text.conversations import TEMPLATES
from megatron_omnibal.models.presets import PRESETS

# Every output may go into a directory that does not exist yet: it is created when written.
_LENGTH_FILE = output_file_type(".npz", ".json", create_parent=True)
_REPORT_FILE = output_file_type(create_parent=True)
_PNG_FILE = output_file_type(".png", create_parent=True)

HELP = "compute per-sample length statistics (image tiles, tokens) of a VLM dataset"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_input_arguments(parser)
    _add_image_arguments(parser)
    _add_video_arguments(parser)
    _add_run_arguments(parser)


def _add_input_arguments(parser: argparse.ArgumentParser) -> None:
    """The dataset, the model it is measured for, the output and the chat template."""
    parser.add_argument("dataset", help="LLaVA-style JSON list, JSONL, ShareGPT/messages "
                        "records, InternVL meta JSON, or a Megatron-Energon dataset (a folder "
                        "prepared with `energon prepare`, or a metadataset YAML)")
    parser.add_argument("--model", required=True, metavar="NAME|FILE|HF_DIR",
                        help="the model the lengths are for: a preset (" + ", ".join(PRESETS)
                             + "), a "
                             "model_spec JSON/YAML, or a Hugging Face checkpoint directory "
                             "(its tiling, template and tokenizer are read from it)")
    parser.add_argument("--tokenizer", default=None,
                        help="local tokenizer: a Hugging Face directory or a tokenizer.json "
                             "(default: the --model checkpoint directory's)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a tokenizer directory's own Python code (auto_map), e.g. "
                             "InternLM2's; it runs on this machine")
    parser.add_argument("--out", required=True, type=_LENGTH_FILE,
                        help="length file: .npz (one file), or .json (a meta file naming one "
                             "length file per dataset, in --format); the configuration of this "
                             "run is stored in it")
    parser.add_argument("--template", choices=TEMPLATES,
                        help="chat template (default: the model's: a checkpoint's own where it "
                             "ships one); 'hf' renders with the tokenizer's own chat template, "
                             "the others are built in (InternVL2.5, LLaVA-1.5's Vicuna, "
                             "Qwen2-VL's ChatML)")
    parser.add_argument("--system-prompt", default=None,
                        help="system message (default: the template's own)")


def _add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """Image tiling and the token limit."""
    parser.add_argument("--tiling", choices=["dynamic", "fixed", "anyres", "native"],
                        help="image tiling (default: the model's; anyres = LLaVA-NeXT; native "
                             "= Qwen2.5-VL's resize, the only one for its native-resolution "
                             "tower)")
    parser.add_argument("--min-tiles", type=positive_int, help="InternVL min_dynamic_patch")
    parser.add_argument("--max-tiles", type=positive_int,
                        help="InternVL max_dynamic_patch (default: the model's, else 12; a meta "
                             "entry's max_dynamic_patch overrides it)")
    parser.add_argument("--no-thumbnail", action="store_true",
                        help="InternVL without the thumbnail tile (use_thumbnail=False)")
    parser.add_argument("--pinpoints", default=None,
                        help="LLaVA-NeXT grid resolutions as HxW list, e.g. 336x672,672x336")
    parser.add_argument("--min-pixels", type=positive_int,
                        help="Qwen2.5-VL: fewest pixels of a resized image (default: the "
                             "checkpoint's preprocessor_config.json, else 3136)")
    parser.add_argument("--max-pixels", type=positive_int,
                        help="Qwen2.5-VL: most pixels of a resized image (default: the "
                             "checkpoint's preprocessor_config.json, else 12845056 = "
                             "28 x 28 x 16384)")
    parser.add_argument("--no-dummy-tile", action="store_true",
                        help="text-only samples get vit_num 0 instead of one blank tile "
                             "(Qwen2.5-VL never runs one)")
    parser.add_argument("--max-tokens", type=positive_int, default=None,
                        help="samples with more tokens are errors (or skipped)")


def _add_video_arguments(parser: argparse.ArgumentParser) -> None:
    """Decoding checks, video frames (InternVL's rule and Qwen2.5-VL's)."""
    parser.add_argument("--verify-images", action="store_true",
                        help="decode every image fully (in the worker processes), not only its "
                             "header, and the frames each video can give: truncated or corrupt "
                             "files become bad samples")
    parser.add_argument("--min-frames", type=positive_int, default=8,
                        help="fewest frames a video trains on (InternVL min_num_frame; "
                             "default 8; Qwen2.5-VL follows its own rule and the checkpoint's "
                             "video_preprocessor_config.json instead)")
    parser.add_argument("--max-frames", type=positive_int, default=32,
                        help="most frames a video trains on (InternVL max_num_frame; "
                             "default 32)")
    parser.add_argument("--frame-sampling", default="rand", metavar="rand|middle|fpsX",
                        help="frames of a video: 'rand' one random frame per equal segment "
                             "(InternVL's, default), 'middle' each segment's middle frame, "
                             "'fpsX' X frames per second (count from the duration, at most "
                             "--max-frames); with rand and middle each epoch draws the count "
                             "in [--min-frames, --max-frames] per video")
    parser.add_argument("--frame-seed", type=int, default=0,
                        help="the length records count the frames of epoch 0 drawn with this "
                             "seed (give the --seed of the training run (the balance seed) to "
                             "make them its first epoch's; training redraws every epoch from "
                             "that seed)")
    for flag, kind, what in (
            ("--video-fps", positive_float, "frames taken per second of video (default 2)"),
            ("--video-min-frames", positive_int, "fewest frames (default 4)"),
            ("--video-max-frames", positive_int, "most frames (default 768)"),
            ("--video-min-pixels", positive_int, "fewest pixels per frame (default 100352; "
             "Qwen3-VL: of the whole video, default 4096)"),
            ("--video-max-pixels", positive_int, "most pixels per frame (default 602112; "
             "Qwen3-VL: of the whole video, default 25165824)"),
            ("--video-max-tokens", positive_int,
             "the whole video's pixel budget in tokens, 0.9 x this x 28 x 28 (default 128000; "
             "Qwen3-VL: merge groups a frame where its cap_pixels_per_frame is on, default 768)"),
    ):  # fmt: skip
        parser.add_argument(flag, type=kind, default=None,
                            help=f"Qwen2.5-VL and Qwen3-VL videos: {what}; default: the "
                                 "checkpoint's video_preprocessor_config.json, else the "
                                 "released one (Qwen2.5-VL: qwen-vl-utils')")


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Bad samples, output format, Energon options, workers and plots."""
    parser.add_argument("--extra-keys", default="",
                        help="comma-separated record keys that carry no content, accepted "
                             "besides the known ones (unknown keys are errors)")
    parser.add_argument("--on-error", choices=["error", "skip"], default="error",
                        help="bad sample: stop (default) or leave it out and list it in the "
                             "skipped report")
    parser.add_argument("--skipped", default=None, type=_REPORT_FILE,
                        help="skipped report path (default: <out stem>.skipped.json)")
    parser.add_argument("--format", choices=["json", "jsonl", "npz"], default="json",
                        help="per-dataset file format of a .json (meta) output (default json)")
    parser.add_argument("--image-root", default=None,
                        help="image folder of a JSON/JSONL input (default: its folder)")
    parser.add_argument("--split", default="train",
                        help="Energon dataset: the split part measured (default train)")
    parser.add_argument("--energon-task-encoder", default=None, metavar="MODULE:CLASS",
                        help="Energon dataset of your own format: your task encoder class "
                             "(built without arguments), whose encode_sample(sample) returns "
                             "a record ('conversations' or 'messages', 'images' as the images "
                             "themselves); default: Energon's VQASample, CaptioningSample and "
                             "CrudeWebdataset samples are read directly")
    parser.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                        help="worker processes (default: all cores)")
    parser.add_argument("--chunk-size", type=positive_int, default=256,
                        help="samples per work item")
    parser.add_argument("--png", default=None, type=_PNG_FILE,
                        help="also plot the tiles and tokens distributions per dataset to this "
                             "PNG file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _pinpoints(text: str) -> tuple[tuple[int, int], ...]:
    try:
        pairs = [p.lower().split("x") for p in text.split(",") if p.strip()]
        return tuple((int(h), int(w)) for h, w in pairs)
    except ValueError as exc:
        raise ValueError(f"--pinpoints: expected HxW[,HxW...], got {text!r}") from exc


def build_config(args: argparse.Namespace):
    """The StatsConfig of the model's data side with the flags given on top."""
    from dataclasses import replace
    from pathlib import Path

    from megatron_omnibal.data.frames import FrameSettings
    from megatron_omnibal.data.sample.config import ModelLayout, StatsConfig
    from megatron_omnibal.models.data_side import model_data_side
    from megatron_omnibal.models.resolve import resolve_model

    spec = resolve_model(args.model)
    side = model_data_side(spec, args.model if Path(args.model).is_dir() else None)
    tiling = side.tiling
    if args.tiling and (args.tiling == "native") != spec.vit.native_resolution:
        raise ValueError(f"--tiling {args.tiling}: model {spec.name} takes "
                         + ("native-resolution images (--tiling native)"
                            if spec.vit.native_resolution else "tiles, not native resolution"))
    if (args.min_pixels or args.max_pixels) and not spec.vit.native_resolution:
        raise ValueError(f"--min-pixels / --max-pixels: model {spec.name} takes tiles, not "
                         "native-resolution images")
    if args.tiling and args.tiling != tiling.mode:
        tiling = replace(tiling, mode=args.tiling, max_tiles=12 if args.tiling == "dynamic"
                         else 1, features_per_side=spec.vit.image_size // spec.vit.patch_size)
    overrides = {"min_tiles": args.min_tiles, "max_tiles": args.max_tiles,
                 "pinpoints": _pinpoints(args.pinpoints) if args.pinpoints else None,
                 "min_pixels": args.min_pixels, "max_pixels": args.max_pixels}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    low, high = overrides.get("min_tiles", tiling.min_tiles), overrides.get("max_tiles",
                                                                         tiling.max_tiles)
    if low > high:
        raise ValueError(f"--min-tiles {low} is above --max-tiles {high} (the model's default "
                         "where not given)")
    tiling = replace(tiling, **overrides)
    if args.no_thumbnail:
        tiling = replace(tiling, thumbnail=False)
    video = {key: getattr(args, f"video_{key}") for key in ("fps", "min_frames", "max_frames",
                                                             "min_pixels", "max_pixels")}
    video["max_video_tokens"] = args.video_max_tokens
    video = {k: v for k, v in video.items() if v is not None}
    if video and not spec.vit.native_resolution:
        raise ValueError(f"--video-*: model {spec.name} takes videos as frames of tiles "
                         "(--min-frames, --max-frames, --frame-sampling)")
    native_video = replace(side.native_video, **video)
    template = args.template or side.template
    if template is None:
        raise ValueError(f"{side.template_note}: give --template ({', '.join(TEMPLATES)}; "
                         "hf for the tokenizer's own chat template)")
    tokenizer = args.tokenizer or side.tokenizer
    if tokenizer is None:
        raise ValueError(f"--model {args.model} holds no tokenizer: give --tokenizer")
    return StatsConfig(tokenizer=tokenizer, tiling=tiling, template=template,
                       image_style=side.image_style, system=args.system_prompt,
                       dummy_tile=side.dummy_tile and not args.no_dummy_tile,
                       max_tokens=args.max_tokens,
                       trust_remote_code=args.trust_remote_code,
                       verify_images=args.verify_images,
                       extra_keys=tuple(k for k in args.extra_keys.split(",") if k),
                       frames=FrameSettings(min_frames=args.min_frames,
                                            max_frames=args.max_frames,
                                            sampling=args.frame_sampling),
                       frame_seed=args.frame_seed, native_video=native_video,
                       model=ModelLayout.from_spec(spec))


def run(args: argparse.Namespace) -> int:
    from megatron_omnibal.data.energon.source import EnergonOptions
    from megatron_omnibal.data.stats.compute import StatsError, compute_stats, write_outputs

    config = build_config(args)
    energon = EnergonOptions(split=args.split, task_encoder=args.energon_task_encoder)
    try:
        result = compute_stats(args.dataset, config, image_root=args.image_root,
                               on_error=args.on_error, workers=args.workers,
                               chunk_size=args.chunk_size, progress=not args.no_progress,
                               energon=energon)
    except StatsError as exc:
        print(f"omnibal stats: error: {exc}", file=sys.stderr)
        return 1
    written = write_outputs(result, args.out, args.format, args.skipped)
    if args.png:
        from megatron_omnibal.data.stats.plots import plot_stats

        written.append(plot_stats(result.stats, args.png))
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
    videos = sum(len(v) for v in result.videos)
    if videos and config.native_video.rule == "qwen3_vl" and config.tiling.mode == "native":
        v = config.native_video
        cap = f", at most {v.max_video_tokens} tokens a frame" if v.cap_pixels_per_frame else ""
        print(f"videos: {videos}; Qwen3-VL's rule: {v.fps:g} frames/s, {v.min_frames}-"
              f"{v.max_frames} frames, {v.min_pixels}-{v.max_pixels} pixels per video{cap}, "
              "timestamps between temporal patches, the same every epoch", file=sys.stderr)
    elif videos and config.tiling.mode == "native":
        v = config.native_video
        print(f"videos: {videos}; Qwen2.5-VL's rule: {v.fps:g} frames/s, {v.min_frames}-"
              f"{v.max_frames} frames, {v.min_pixels}-{v.max_pixels} pixels per frame within "
              f"{v.max_video_tokens} tokens per video, the same every epoch", file=sys.stderr)
    elif videos:
        frames = config.frames
        print(f"videos: {videos}; frames {frames.min_frames}-"
              f"{frames.max_frames}, sampling {frames.sampling}, counted for epoch 0 of frame "
              f"seed {config.frame_seed}", file=sys.stderr)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0
