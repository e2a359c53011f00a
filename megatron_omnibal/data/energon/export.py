"""The project's dataset formats -> a prepared Megatron-Energon dataset (`omnibal
export-energon`), so a team can move its data either way.

Each record becomes one WebDataset sample of a CrudeWebdataset (data/energon/source.py reads it
back): `KEY.json` holds the record with each image and video path replaced by its member name,
`KEY.<k>.<ext>` the k-th image's bytes and `KEY.v<k>.<ext>` the k-th video's, as they are (no
re-encoding; a video's `clip` stays in the record). Keys are the record's
position (`s000000042`), shards hold `shard_size` samples. The folder is then prepared as
`energon prepare` does (Energon's own index writer, everything in the train split, image sizes
in the media metadata) with a dataset.yaml naming CrudeWebdataset. An InternVL meta file gives
one prepared folder per dataset and a metadataset YAML whose `blend_epochized` repetitions are
the repeat_time values.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import dataclass, replace
from pathlib import Path

from megatron_omnibal.data.energon.members import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from megatron_omnibal.data.energon.source import is_energon
from megatron_omnibal.data.formats.annotations import DatasetSpec, read_annotations
from megatron_omnibal.data.formats.raw import parse_record
from megatron_omnibal.data.formats.records import read_sample
from megatron_omnibal.data.text.conversations import SampleError

DATASET_YAML = ("__module__: megatron.energon\n__class__: CrudeWebdataset\n"
                "subflavors:\n  source: omnibal-export\n")


class ExportError(ValueError):
    """A record that cannot be exported (the message names the file and line)."""


@dataclass(frozen=True)
class Exported:
    """What an export wrote: the path to train from, the datasets and their samples."""

    path: Path  # the prepared folder, or the metadataset YAML (several datasets)
    folders: list[Path]
    samples: list[int]


def export_energon(data: str | os.PathLike, out: str | os.PathLike,
                   image_root: str | os.PathLike | None = None, shard_size: int = 1000,
                   extra_keys: tuple[str, ...] = ()) -> Exported:
    """Write the dataset(s) at `data` (JSON list, JSONL, InternVL meta) as prepared Energon
    dataset(s) under `out` (created; must be empty or absent)."""
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    if is_energon(data):
        raise ExportError(f"{data} is already an Energon dataset")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out}: the output folder is not empty")
    specs, is_meta = read_annotations(data, image_root)
    folders, counts = [], []
    for spec in specs:
        folder = out / _folder_name(spec.name, folders) if is_meta else out
        counts.append(_write_shards(spec, folder, shard_size, extra_keys))
        prepare(folder)
        folders.append(folder)
    if not is_meta:
        return Exported(out, folders, counts)
    lines = ["__module__: megatron.energon", "__class__: MetadatasetV2", "splits:", "  train:",
             "    blend_epochized:"]
    for spec, folder in zip(specs, folders, strict=True):
        lines += [f"      - repetitions: {spec.repeat_time:g}",
                  f"        path: {folder.name}"]
    meta = out / "metadataset.yaml"
    meta.write_text("\n".join(lines) + "\n")
    return Exported(meta, folders, counts)


def _folder_name(name: str, taken: list[Path]) -> str:
    stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "dataset"
    while stem in {p.name for p in taken}:
        stem += "_"
    return stem


def _write_shards(spec: DatasetSpec, folder: Path, shard_size: int,
                  extra_keys: tuple[str, ...]) -> int:
    """The records of one dataset as shards under `folder`; returns the samples written."""
    folder.mkdir(parents=True, exist_ok=True)
    records = replace(spec, repeat_time=1.0).records()  # all; the metadataset repeats them
    if not records:
        raise ExportError(f"{spec.annotation}: no records to export")
    for start in range(0, len(records), shard_size):
        with tarfile.open(folder / f"shard-{start // shard_size:06d}.tar", "w") as tf:
            for raw in records[start:start + shard_size]:
                where = f"{spec.annotation}:{raw.line}"
                try:
                    record = parse_record(raw)
                    images, videos, _ = read_sample(record, extra_keys)
                except SampleError as exc:
                    raise ExportError(f"{where}: {exc}") from exc
                key = f"s{raw.index:09d}"
                names = {}
                media = [("image", rel, f"{k}", IMAGE_EXTENSIONS) for k, rel in enumerate(images)]
                media += [("video", v.path, f"v{k}", VIDEO_EXTENSIONS)
                          for k, v in enumerate(videos)]
                for kind, rel, member, extensions in media:
                    ext = Path(rel).suffix.lower().lstrip(".")
                    if ext not in extensions:
                        raise ExportError(f"{where}: {kind} {rel}: extension '{ext}' is none "
                                          f"of {', '.join(extensions)}")
                    names[rel] = f"{member}.{ext}"
                    try:
                        data = (Path(spec.image_root) / rel).read_bytes()
                    except OSError as exc:
                        raise ExportError(f"{where}: cannot read {kind} {rel} ({exc})") from exc
                    _add(tf, f"{key}.{names[rel]}", data)
                _add(tf, f"{key}.json", json.dumps(_renamed(record, names),
                                                   ensure_ascii=False).encode())
    return len(records)


def _renamed(record: dict, names: dict[str, str]) -> dict:
    """The record with its image and video paths replaced by member names (the same key and
    shape)."""
    out = dict(record)
    for key in ("image", "images", "video", "videos"):
        value = out.get(key)
        if isinstance(value, str) and value:
            out[key] = names[value]
        elif isinstance(value, list):
            out[key] = [names[p if isinstance(p, str) else p["path"]] for p in value]
    return out


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def prepare(folder: Path) -> None:
    """What `energon prepare --split-ratio 1,0,0 --media-metadata-by-extension
    --sample-type CrudeWebdataset` writes: the index, split and dataset.yaml."""
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory
    from megatron.energon.media.extractor import MediaFilterConfig

    tars = sorted(p.name for p in folder.glob("*.tar"))
    BaseWebdatasetFactory.prepare_dataset(
        EPath(folder), tars, split_parts_ratio=[("train", 1.0), ("val", 0.0), ("test", 0.0)],
        shuffle_seed=None, workers=1,
        media_filter=MediaFilterConfig.parse(None, False, True))
    (folder / ".nv-meta" / "dataset.yaml").write_text(DATASET_YAML)
