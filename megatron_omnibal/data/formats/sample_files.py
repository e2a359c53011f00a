"""Where a sample's record and images come from: annotation files with an image folder, or the
members of a Megatron-Energon WebDataset sample (data/energon/source.py).

`omnibal stats` and the training loader read every sample through one of these, so both see
the same record and the same image bytes whatever the storage. A record names its images by
the paths (folder) or member names (Energon) that data/formats/records.py reads from it.
"""

from __future__ import annotations

import os
from typing import Protocol

from PIL import Image

from megatron_omnibal.data.formats.raw import RawRecord, parse_record
from megatron_omnibal.data.images.header import image_size
from megatron_omnibal.data.images.tiles import decode_image


class LoadedSample(Protocol):
    """One sample: its record, and access to the images it names."""

    record: dict

    def where(self, name: str) -> str:
        """The image `name` as an error message names it (a path)."""

    def image_size(self, name: str) -> tuple[int, int]:
        """(width, height) without decoding pixels where the storage allows."""

    def decode(self, name: str) -> Image.Image:
        """The image fully decoded to RGB."""

    def video_path(self, name: str) -> str:
        """The local file of video `name`."""


class SampleFiles(Protocol):
    """The samples of one dataset, by their raw record."""

    def sample(self, raw: RawRecord) -> LoadedSample: ...


class FolderSample:
    """A record of an annotation file whose images are files under `root`."""

    def __init__(self, record: dict, root: str) -> None:
        self.record = record
        self.root = root

    def where(self, name: str) -> str:
        return os.path.join(self.root, name)

    def image_size(self, name: str) -> tuple[int, int]:
        return image_size(self.where(name))

    def decode(self, name: str) -> Image.Image:
        return decode_image(self.where(name))

    def video_path(self, name: str) -> str:
        return self.where(name)


class FolderFiles:
    """Annotation records (JSON, JSONL) with their images under one folder."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = str(root)

    def sample(self, raw: RawRecord) -> FolderSample:
        return FolderSample(parse_record(raw), self.root)
