"""A dataset path -> the datasets it names, whatever its format: annotation files (JSON list,
JSONL, InternVL meta JSON; data/formats/annotations.py) or a Megatron-Energon dataset (a
prepared folder or a metadataset YAML; data/energon/source.py). `omnibal stats`, the training
loader and `omnibal finetune` all read their input here."""

from __future__ import annotations

import os
from pathlib import Path

from megatron_omnibal.data.energon.source import EnergonOptions, is_energon, read_energon
from megatron_omnibal.data.formats.annotations import DatasetSpec, read_annotations


def read_inputs(path: str | os.PathLike, image_root: str | os.PathLike | None = None,
                energon: EnergonOptions | None = None) -> tuple[list[DatasetSpec], bool]:
    """The datasets an input names, and whether it was a meta file (or an Energon
    metadataset). A prepared Energon folder or metadataset YAML is read with `energon`."""
    path = Path(path)
    if is_energon(path):
        if image_root is not None:
            raise ValueError(f"{path}: --image-root does not apply to an Energon dataset (its "
                             "images are shard members)")
        return read_energon(path, energon or EnergonOptions())
    return read_annotations(path, image_root)
