"""Megatron-Energon datasets as a source of samples: a prepared WebDataset folder (`energon
prepare`: `.nv-meta/` with the split, the sample index and, when prepared with
`--media-metadata-by-...`, each image's size), or a metadataset YAML naming several.

Every sample has a stable identity, (dataset, shard, key): the length file stores it, so an
epoch plan names samples, not positions, and training fetches each planned sample by its key
through Energon's own index and tar reader (random access, no shard streaming). A sample is
decoded by Energon's sample loader (the dataset.yaml's sample type and field_map, images kept
as encoded bytes) and turned into the project's record shape (data/formats/records.py), so `omnibal
stats` and training render, tokenize and tile it exactly as a JSON record:

- VQASample: the `context` is the human turn, the answer the assistant turn (Megatron-LM's VLM
  recipe maps them from the conversation in the `json` member); several answers: the first
  of the highest weight.
- CaptioningSample: the image alone as the human turn, the caption as the answer.
- CrudeSample (CrudeWebdataset): the `json` member is a project record (or a bare conversation
  list); its images are the image members it names, else all of them in tar order; its videos
  (`video`, `videos`: member names, as `omnibal export-energon` writes them) are read from
  memory, as they are (no file written), else all its video members in tar order.
- Any format through the user's task encoder (`module:Class`, built without arguments): its
  `encode_sample(sample)` receives the sample as Energon decodes it and returns a project
  record whose `images` are the images themselves (PIL images, HWC uint8 arrays, CHW float
  tensors in [0, 1] as Energon decodes them, or encoded bytes).

A metadataset is Energon's MetadatasetV2 with, for the split, one `path` or a
`blend_epochized` list (`repetitions` per dataset: a whole number, or a fraction in (0, 1]
keeping the first part of the dataset, as InternVL's repeat_time). A `blend` (weights that
sample with replacement, without epochs) is refused: a balanced epoch trains every sample of a
pass exactly once.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_omnibal.data.energon.members import EnergonError
from megatron_omnibal.data.energon.samples import EnergonFiles
from megatron_omnibal.data.formats.annotations import DatasetSpec, checked_repeat
from megatron_omnibal.data.formats.raw import RawRecord

META_FOLDER = ".nv-meta"


@dataclass(frozen=True, kw_only=True)
class EnergonOptions:
    """How Energon datasets are read: the split, and the user's task encoder if any."""

    split: str = "train"
    task_encoder: str | None = None  # "module:Class"

    def __post_init__(self) -> None:
        if not self.split:
            raise ValueError("the Energon split must be named (train, val, test, ...)")
        if self.task_encoder is not None and (
                self.task_encoder.count(":") != 1 or not all(self.task_encoder.split(":"))):
            raise ValueError(f"task encoder {self.task_encoder!r}: expected module:Class")


@dataclass(frozen=True)
class EnergonSpec(DatasetSpec):
    """One prepared Energon dataset (`annotation` and `image_root` are its folder)."""

    split: str = "train"
    task_encoder: str | None = None
    dataset_config: str = "dataset.yaml"
    split_config: str = "split.yaml"

    def records(self) -> list[RawRecord]:
        """The split's samples in Energon's order (shards of the split, then tar order), each
        with its identity (shard, key) as data; a fractional repetition keeps the first
        part."""
        ids = split_samples(self)
        if self.repeat_time < 1:
            ids = ids[:int(len(ids) * self.repeat_time)]
        return [RawRecord(i, i + 1, ident) for i, ident in enumerate(ids)]

    def files(self) -> EnergonFiles:
        return EnergonFiles(self)


def is_energon(path: str | os.PathLike) -> bool:
    """A prepared Energon folder, or a metadataset YAML."""
    path = Path(path)
    return (path.is_dir() and (path / META_FOLDER).is_dir()) or (
        path.is_file() and path.suffix in (".yaml", ".yml"))


def read_energon(path: str | os.PathLike, options: EnergonOptions
                 ) -> tuple[list[EnergonSpec], bool]:
    """The datasets a prepared folder or a metadataset names, and whether it was a
    metadataset."""
    path = Path(path)
    if path.is_dir():
        if not (path / META_FOLDER / ".info.json").is_file() and not (
                path / META_FOLDER / ".info.yaml").is_file():
            raise EnergonError(f"{path}: not a prepared Energon dataset (no {META_FOLDER}/"
                               ".info.json): run `energon prepare` on it first")
        return [_spec(path.name, path, 1.0, options, {})], False
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise EnergonError(f"{path}: cannot read the metadataset ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("__class__") != "MetadatasetV2":
        raise EnergonError(f"{path}: expected an Energon metadataset (__class__: "
                           "MetadatasetV2 with splits)")
    part = (doc.get("splits") or {}).get(options.split)
    if not isinstance(part, dict):
        raise EnergonError(f"{path}: no split '{options.split}' in its splits")
    if "blend" in part:
        raise EnergonError(f"{path}: split '{options.split}' is a weighted `blend` (sampling "
                           "with replacement, without epochs); a balanced epoch trains each "
                           "sample once per pass: write it as `blend_epochized` with "
                           "`repetitions` per dataset")
    entries = part.get("blend_epochized", [part])
    specs, used = [], set()
    for k, entry in enumerate(entries):
        if not isinstance(entry, dict) or "path" not in entry:
            raise EnergonError(f"{path}: split '{options.split}' entry {k} has no 'path'")
        folder = Path(str(entry["path"]))
        folder = folder if folder.is_absolute() else path.parent / folder
        if folder.suffix in (".yaml", ".yml"):
            raise EnergonError(f"{path}: entry {k}: nested metadataset {folder} is not "
                               "supported; name its datasets here")
        repeat = checked_repeat(entry.get("repetitions", 1), f"{path}: entry {k}: repetitions")
        name = folder.name
        while name in used:
            name += "_"
        used.add(name)
        if not (folder / META_FOLDER).is_dir():
            raise EnergonError(f"{path}: entry {k}: {folder} is not a prepared Energon "
                               "dataset")
        specs.append(_spec(name, folder, repeat, options, entry))
    return specs, True


def _spec(name: str, folder: Path, repeat: float, options: EnergonOptions,
          entry: dict) -> EnergonSpec:
    split = entry.get("split_part", options.split)
    return EnergonSpec(name, folder.resolve(), folder.resolve(), repeat, None, split=split,
                       task_encoder=options.task_encoder,
                       dataset_config=entry.get("dataset_config", "dataset.yaml"),
                       split_config=entry.get("split_config", "split.yaml"))


def split_samples(spec: EnergonSpec) -> list[tuple[str, str]]:
    """(shard, key) of every sample of the spec's split, in Energon's order."""
    import sqlite3

    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.metadata import (
        WebdatasetMeta,
        get_info_shard_files,
    )

    path = EPath(spec.annotation)
    try:
        meta = WebdatasetMeta.from_config(path=path, split_part=spec.split,
                                          split_config=spec.split_config)
        names = get_info_shard_files(path)
    except (AssertionError, FileNotFoundError, ValueError) as exc:
        raise EnergonError(f"{spec.annotation}: split '{spec.split}' cannot be read "
                           f"({exc or type(exc).__name__})") from exc
    index = spec.annotation / META_FOLDER / "index.sqlite"
    with sqlite3.connect(f"file:{index}?mode=ro", uri=True) as db:
        rows = db.execute("SELECT tar_file_id, sample_key FROM samples "
                          "ORDER BY tar_file_id, sample_index").fetchall()
    by_shard: dict[str, list[str]] = {}
    for shard_id, key in rows:
        by_shard.setdefault(names[shard_id], []).append(key)
    out = []
    for shard in meta.shards:
        keys = by_shard.get(shard.name, [])
        if len(keys) != shard.count:
            raise EnergonError(f"{spec.annotation}: shard {shard.name} has {len(keys)} samples "
                               f"in the index, {shard.count} in .info: prepare it again")
        out.extend((shard.name, k) for k in keys
                   if f"{shard.name}/{k}" not in meta.sample_excludes)
    return out


def fingerprint(spec: EnergonSpec) -> dict:
    """What identifies a dataset's samples: each shard's sample count and byte size, and the
    sample type configuration. Stored with the lengths; training compares it."""
    meta = spec.annotation / META_FOLDER
    info = meta / ".info.json"
    counts = json.loads(info.read_text())["shard_counts"] if info.is_file() else yaml.safe_load(
        (meta / ".info.yaml").read_text())["shard_counts"]
    config = meta / spec.dataset_config
    return {
        "name": spec.name, "path": str(spec.annotation), "split": spec.split,
        "repetitions": spec.repeat_time,
        "shards": {name: [int(count), _size(spec.annotation / name)]
                   for name, count in counts.items()},
        "dataset_yaml_sha256": hashlib.sha256(config.read_bytes()).hexdigest()
        if config.is_file() else None,
    }


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def changes(stored: dict, now: dict) -> list[str]:
    """What differs between two fingerprints of one dataset, in words."""
    out = []
    for field in ("split", "repetitions"):  # a moved folder is the same dataset
        if stored.get(field) != now.get(field):
            out.append(f"{field} {stored.get(field)!r} -> {now.get(field)!r}")
    old, new = stored.get("shards", {}), now.get("shards", {})
    out += [f"shard {s} removed" for s in old if s not in new]
    out += [f"shard {s} added" for s in new if s not in old]
    for shard in (s for s in old if s in new and old[s] != new[s]):
        (c0, b0), (c1, b1) = old[shard], new[shard]
        what = [f"{c0} -> {c1} samples"] if c0 != c1 else []
        what += [f"{b0} -> {b1} bytes"] if b0 != b1 else []
        out.append(f"shard {shard}: {', '.join(what)}")
    if stored.get("dataset_yaml_sha256") != now.get("dataset_yaml_sha256"):
        out.append("dataset.yaml (sample type or field map) changed")
    return out
