"""`omnibal export-energon`: the project's dataset formats -> a prepared Energon dataset."""

from __future__ import annotations

import argparse
import sys

from megatron_omnibal.cli_args import positive_int

HELP = "write a JSON/JSONL/InternVL-meta dataset as prepared Megatron-Energon WebDataset shards"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dataset", help="LLaVA-style JSON list, JSONL, ShareGPT/messages "
                        "records, or InternVL meta JSON")
    parser.add_argument("--out", required=True,
                        help="output folder (created; must be empty): a prepared Energon "
                             "dataset, or for a meta file one per dataset and "
                             "metadataset.yaml")
    parser.add_argument("--image-root", default=None,
                        help="image folder of a JSON/JSONL input (default: its folder)")
    parser.add_argument("--shard-size", type=positive_int, default=1000,
                        help="samples per tar shard (default 1000)")
    parser.add_argument("--extra-keys", default="",
                        help="comma-separated record keys that carry no content, accepted "
                             "besides the known ones")


def run(args: argparse.Namespace) -> int:
    from megatron_omnibal.data.energon.export import ExportError, export_energon

    try:
        done = export_energon(args.dataset, args.out, args.image_root, args.shard_size,
                              tuple(k for k in args.extra_keys.split(",") if k))
    except ExportError as exc:
        print(f"omnibal export-energon: error: {exc}", file=sys.stderr)
        return 1
    print(f"{sum(done.samples)} samples in {len(done.folders)} dataset(s); train with "
          f"{done.path}", file=sys.stderr)
    return 0
