"""Megatron-Energon samples read by identity and turned into the project's record shape.

A sample is fetched by its key through Energon's own index and tar reader (random access, no
shard streaming), decoded by Energon's sample loader (the dataset.yaml's sample type and field
map, images kept as encoded bytes) and converted, so `omnibal stats` and training render,
tokenize and tile it exactly as a JSON record (the rules: data/energon/source.py).
"""

from __future__ import annotations

import importlib
import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from megatron_omnibal.data.energon.members import (
    IMAGE_EXTENSIONS,
    VIDEO_EXTENSIONS,
    EnergonError,
    MemberError,
)
from megatron_omnibal.data.formats.raw import RawRecord
from megatron_omnibal.data.images.header import checked_size, image_bytes_size
from megatron_omnibal.data.images.tiles import decode_image_bytes
from megatron_omnibal.data.text.conversations import SampleError
from megatron_omnibal.data.video.reader import VideoBytes

if TYPE_CHECKING:
    from megatron_omnibal.data.energon.source import EnergonSpec


def load_task_encoder(name: str) -> Any:
    """An instance of the user's task encoder class named `module:Class`."""
    module, _, cls = name.partition(":")
    try:
        return getattr(importlib.import_module(module), cls)()
    except (ImportError, AttributeError) as exc:
        raise EnergonError(f"task encoder {name}: {exc}") from exc


class EnergonSample:
    """One Energon sample as a record whose images and videos are members (or decoded
    images)."""

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

    def video_path(self, name: str) -> VideoBytes:
        """The video member `name`, read from memory (data/video/reader.py opens it like a file)."""
        video = self.images.get(name)
        if not isinstance(video, bytes) or name.rsplit(".", 1)[-1].lower() not in \
                VIDEO_EXTENSIONS:
            raise SampleError(f"{self.base}: the record names video '{name}', the sample's "
                              f"video members are {self.videos() or 'none'}")
        return VideoBytes(self.where(name), video)

    def videos(self) -> list[str]:
        return [k for k, v in self.images.items() if isinstance(v, bytes)
                and k.rsplit(".", 1)[-1].lower() in VIDEO_EXTENSIONS]


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
    videos = {k: v for k, v in members.items() if k.rsplit(".", 1)[-1].lower()
              in VIDEO_EXTENSIONS}
    if not any(k in record for k in ("image", "images")) and images:
        record["images"] = list(images)
    if not any(k in record for k in ("video", "videos")) and videos:
        record["videos"] = list(videos)
    return record, {**images, **videos}


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
