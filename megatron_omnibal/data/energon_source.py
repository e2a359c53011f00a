"""Megatron-Energon datasets as a source of samples: a prepared WebDataset folder (`energon
prepare`: `.nv-meta/` with the split, the sample index and, when prepared with
`--media-metadata-by-...`, each image's size), or a metadataset YAML naming several.

Every sample has a stable identity, (dataset, shard, key): the length file stores it, so an
epoch plan names samples, not positions, and training fetches each planned sample by its key
through Energon's own index and tar reader (random access, no shard streaming). A sample is
decoded by Energon's sample loader (the dataset.yaml's sample type and field_map, images kept
as encoded bytes) and turned into the project's record shape (data/records.py), so `omnibal
stats` and training render, tokenize and tile it exactly as a JSON record:

- VQASample: the `context` is the human turn, the answer the assistant turn (Megatron-LM's VLM
  recipe maps them from the conversation in the `json` member); several answers: the first
  of the highest weight.
- CaptioningSample: the image alone as the human turn, the caption as the answer.
- CrudeSample (CrudeWebdataset): the `json` member is a project record (or a bare conversation
  list); its images are the image members it names, else all of them in tar order.
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
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image

from megatron_omnibal.data.annotations import DatasetSpec, RawRecord, checked_repeat
from megatron_omnibal.data.conversations import SampleError
from megatron_omnibal.data.image_header import checked_size, image_bytes_size
from megatron_omnibal.data.image_tiles import ImageDecodeError, decode_image_bytes

META_FOLDER = ".nv-meta"
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")


class EnergonError(ValueError):
    """An Energon dataset that cannot be read as asked (the message names it)."""


class MemberError(ImageDecodeError):
    """A shard member that cannot be read: a bad sample, like an image that cannot be
    decoded."""


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


def load_task_encoder(name: str) -> Any:
    """An instance of the user's task encoder class named `module:Class`."""
    module, _, cls = name.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError) as exc:
        raise EnergonError(f"task encoder {name}: {exc}") from exc


class EnergonSample:
    """One Energon sample as a record whose images are members (or decoded images)."""

    def __init__(self, record: dict, images: dict[str, Any], base: str,
                 media: dict[str, tuple[int, int]]) -> None:
        self.record = record
        self.images = images
        self.base = base
        self.media = media

    def where(self, name: str) -> str:
        return f"{self.base}.{name}"

    def _image(self, name: str) -> Any:
        if name not in self.images:
            raise SampleError(f"{self.base}: the record names image '{name}', the sample has "
                              f"{sorted(self.images) or 'no images'}")
        return self.images[name]

    def image_size(self, name: str) -> tuple[int, int]:
        image = self._image(name)
        if isinstance(image, bytes):
            if name in self.media:
                return checked_size(self.where(name), self.media[name])
            return image_bytes_size(image, self.where(name))
        return self.decode(name).size

    def decode(self, name: str) -> Image.Image:
        image = self._image(name)
        if isinstance(image, bytes):
            return decode_image_bytes(image, self.where(name))
        if isinstance(image, Image.Image):
            return image.convert("RGB")
        array = np.asarray(image.detach().cpu() if hasattr(image, "detach") else image)
        if array.dtype != np.uint8:  # CHW floats in [0, 1], as Energon decodes images
            array = np.clip(np.rint(array * 255.0), 0, 255).astype(np.uint8).transpose(1, 2, 0)
        return Image.fromarray(array).convert("RGB")

    def video_path(self, name: str) -> str:
        raise SampleError(f"{self.base}: video samples from Energon datasets are not supported")


class EnergonFiles:
    """Samples of one Energon dataset by identity, read through Energon's index and tar
    reader. Opened lazily once per process (DataLoader workers fork after it is made)."""

    _open: dict[tuple[int, EnergonSpec], _Reader] = {}

    def __init__(self, spec: EnergonSpec) -> None:
        self.spec = spec

    def sample(self, raw: RawRecord) -> EnergonSample:
        key = (os.getpid(), self.spec)
        if key not in EnergonFiles._open:
            EnergonFiles._open[key] = _Reader(self.spec)
        return EnergonFiles._open[key].sample(*raw.data)


class _Reader:
    def __init__(self, spec: EnergonSpec) -> None:
        from megatron.energon import WorkerConfig
        from megatron.energon.dataset_config import get_dataset_from_config
        from megatron.energon.epathlib import EPath
        from megatron.energon.flavors.webdataset.itar_reader import SqliteITarEntryReader

        self.spec = spec
        self.encoder = load_task_encoder(spec.task_encoder) if spec.task_encoder else None
        path = EPath(spec.annotation)
        # Images stay encoded bytes for the model's own processing; a task encoder gets
        # them as Energon decodes them.
        decoding = {} if self.encoder is not None else {"decoder": TextDecoder()}
        self.factory = get_dataset_from_config(
            path, dataset_config=spec.dataset_config, split_config=spec.split_config,
            split_part=spec.split, training=False,
            worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0), **decoding)
        self.reader = SqliteITarEntryReader(path, part_filter=self.factory.part_filter)
        index = self.reader.sqlite_reader
        self.index = index if index.db_has_media_metadata() else None
        self.sample_type = self.factory.__sample_type__.__name__

    def sample(self, shard: str, key: str) -> EnergonSample:
        base = f"{self.spec.annotation}/{shard}/{key}"
        try:
            raw = self.reader[key]
        except KeyError as exc:
            raise SampleError(f"{base}: no such sample in the index (the dataset changed since "
                              "the length file was made)") from exc
        except (OSError, ValueError, EOFError) as exc:
            raise MemberError(f"{base}: cannot read the sample from its shard ({exc})") from exc
        if raw["__shard__"] != shard:
            raise SampleError(f"{base}: the key is now in shard {raw['__shard__']} (the dataset "
                              "changed since the length file was made)")
        members = {k: v for k, v in raw.items() if not k.startswith("__")}
        try:
            typed = self.factory.load_sample(raw)
        except Exception as exc:  # noqa: BLE001 - Energon's field maps and decoders raise many
            raise MemberError(f"{base}: Energon cannot load the sample ({exc})") from exc
        if self.encoder is not None:
            record, images = _encoded_record(self.encoder.encode_sample(typed), base)
        else:
            record, images = builtin_record(typed, self.sample_type, members, base)
        record.setdefault("id", f"{shard}/{key}")
        media = {name: self._media(key, name) for name, image in images.items()
                 if isinstance(image, bytes)}
        return EnergonSample(record, images, base, {k: v for k, v in media.items() if v})

    def _media(self, key: str, name: str) -> tuple[int, int] | None:
        """An image member's size from the prepared media metadata, if stored."""
        if self.index is None:
            return None
        found = self.index.get_media_metadata(f"{key}.{name}")
        if found is None or found[0] != "image":
            return None
        info = json.loads(found[1])
        return int(info["width"]), int(info["height"])


class TextDecoder:
    """WebDataset's decoding of text members (json, txt, ...), images left as encoded bytes."""

    def __init__(self) -> None:
        import webdataset

        self._decoder = webdataset.autodecode.Decoder([])

    def __call__(self, sample: dict) -> dict:
        return self._decoder(sample)

    def config(self) -> dict:
        return {"image_decode": "bytes"}


def builtin_record(typed: Any, sample_type: str, members: dict[str, Any],
                   base: str) -> tuple[dict, dict[str, bytes]]:
    """The project record of a sample of one of Energon's standard types (images as members)."""
    if sample_type == "CrudeSample":
        return _crude_record(members, base)
    if sample_type not in ("VQASample", "CaptioningSample"):
        raise EnergonError(f"{base}: sample type {sample_type}: omnibal reads VQASample, "
                           "CaptioningSample and CrudeWebdataset samples; give your task "
                           "encoder (--energon-task-encoder module:Class) for others")
    name = next((k for k, v in members.items() if v is typed.image), None)
    if name is None or not isinstance(typed.image, bytes):
        raise SampleError(f"{base}: the sample's image is not one of its members")
    if sample_type == "CaptioningSample":
        turns = [("", typed.caption)]
    else:
        turns = [(typed.context, _answer(typed.answers, typed.answer_weights, base))]
    conversation = [turn for human, gpt in turns for turn in (
        {"from": "human", "value": _text(human, base)}, {"from": "gpt", "value": _text(gpt,
                                                                                        base)})]
    return {"conversations": conversation, "images": [name]}, {name: typed.image}


def _text(value: Any, base: str) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8")
    if not isinstance(value, str):
        raise SampleError(f"{base}: expected text, the field map gives {value!r:.60}")
    return value


def _answer(answers: Any, weights: Any, base: str) -> str:
    """The answer trained: the only one, else the first of the highest weight."""
    if isinstance(answers, str | bytes):
        return _text(answers, base)
    if not answers:
        raise SampleError(f"{base}: VQA sample without an answer")
    best = int(np.argmax(np.asarray(weights, np.float64))) if weights is not None else 0
    return _text(answers[best], base)


def _crude_record(members: dict[str, Any], base: str) -> tuple[dict, dict[str, bytes]]:
    if "json" not in members:
        raise SampleError(f"{base}: a crude sample needs a 'json' member holding its record, "
                          f"it has {sorted(members)}")
    record = members["json"]
    if isinstance(record, bytes | str):  # as stored; Energon's decoders give it parsed
        try:
            record = json.loads(record)
        except (ValueError, UnicodeDecodeError) as exc:
            raise SampleError(f"{base}.json: invalid JSON ({exc})") from exc
    record = {"conversations": record} if isinstance(record, list) else record
    if not isinstance(record, dict):
        raise SampleError(f"{base}.json: expected a record object or a conversation list")
    record = dict(record)
    images = {k: v for k, v in members.items() if k.rsplit(".", 1)[-1].lower()
              in IMAGE_EXTENSIONS}
    if not any(k in record for k in ("image", "images")) and images:
        record["images"] = list(images)
    return record, images


def _encoded_record(out: Any, base: str) -> tuple[dict, dict[str, Any]]:
    """The record a task encoder returned, its images named image0, image1, ..."""
    if not isinstance(out, dict):
        raise SampleError(f"{base}: the task encoder returned {type(out).__name__}, expected "
                          "a record dict ('conversations' or 'messages', 'images')")
    record = dict(out)
    images = record.pop("images", None) or []
    if "image" in record:
        images = [record.pop("image")]
    named = {f"image{k}": image for k, image in enumerate(images)}
    if named:
        record["images"] = list(named)
    return record, named
