"""What an Energon sample's shard members may be, and the errors of reading them: shared by the
reader of a dataset (source.py), of its samples (samples.py) and the export (export.py)."""

from __future__ import annotations

from megatron_omnibal.data.images.tiles import ImageDecodeError

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
VIDEO_EXTENSIONS = ("mp4", "mkv", "webm", "avi", "mov", "ts")


class EnergonError(ValueError):
    """An Energon dataset that cannot be read as asked (the message names it)."""


class MemberError(ImageDecodeError):
    """A shard member that cannot be read: a bad sample, like an image that cannot be
    decoded."""
