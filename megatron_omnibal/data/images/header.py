"""Image sizes from file headers, without decoding pixels.

Length statistics need only each image's width and height, and a dataset holds millions of
images: decoding them would cost hours, reading a few header bytes costs microseconds. PNG and
JPEG (nearly every VLM dataset) are parsed here directly; other formats go through Pillow, whose
`Image.open` is lazy and reads only the header too. The size is the stored one, before any EXIF
rotation, as `Image.open(path).convert("RGB")` in the training loaders sees it.
"""

from __future__ import annotations

import io
import os
import struct
from typing import BinaryIO

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Start-of-frame markers carry the size; C4 (DHT), C8 (JPG) and CC (DAC) share the range.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
# Markers without a length field: TEM, RSTn, SOI.
_JPEG_STANDALONE = frozenset([0x01, 0xD8, *range(0xD0, 0xD8)])


class ImageHeaderError(ValueError):
    """An image whose header cannot be read: missing, truncated or not an image."""


def image_size(path: str | os.PathLike) -> tuple[int, int]:
    """(width, height) of the image at `path`, read from its header only."""
    try:
        with open(path, "rb") as fh:
            size = _stream_size(fh, path)
    except OSError as exc:
        raise ImageHeaderError(f"cannot read image {os.fspath(path)}: "
                               f"{exc.strerror or exc}") from exc
    except ImageHeaderError as exc:
        raise ImageHeaderError(f"corrupt image {os.fspath(path)}: {exc}") from exc
    return checked_size(os.fspath(path), size)


def image_bytes_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) of an encoded image held in memory (a WebDataset member), from its
    header; `where` names it in errors."""
    try:
        size = _stream_size(io.BytesIO(data), io.BytesIO(data))
    except ImageHeaderError as exc:
        raise ImageHeaderError(f"corrupt image {where}: {exc}") from exc
    return checked_size(where, size)


def checked_size(where: str, size: tuple[int, int]) -> tuple[int, int]:
    """`size` of the image `where`, refused when empty or a decompression bomb."""
    if size[0] <= 0 or size[1] <= 0:
        raise ImageHeaderError(f"corrupt image {where}: size {size[0]}x{size[1]}")
    check_pixel_limit(where, size)
    return size


def _stream_size(fh: BinaryIO, source: str | os.PathLike | BinaryIO) -> tuple[int, int]:
    """The size from the header at the start of `fh`; Pillow opens `source` for other
    formats."""
    head = fh.read(26)
    if head.startswith(_PNG_SIGNATURE):
        return _png_size(head)
    if head.startswith(b"\xff\xd8"):
        fh.seek(2)
        return _jpeg_size(fh)
    return _pillow_size(source)


def check_pixel_limit(path: str | os.PathLike, size: tuple[int, int]) -> None:
    """Refuse what Pillow refuses to decode (a decompression bomb): 2x Image.MAX_IMAGE_PIXELS."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if limit and size[0] * size[1] > 2 * limit:
        raise ImageHeaderError(
            f"decompression bomb {os.fspath(path)}: {size[0]}x{size[1]} = "
            f"{size[0] * size[1]:,} pixels, over Pillow's limit of {2 * limit:,}")


def _png_size(head: bytes) -> tuple[int, int]:
    if len(head) < 24 or head[12:16] != b"IHDR":
        raise ImageHeaderError("PNG without an IHDR chunk")
    width, height = struct.unpack(">II", head[16:24])
    return int(width), int(height)


def _jpeg_size(fh) -> tuple[int, int]:
    """Walk the marker segments up to the first start-of-frame (APPn/EXIF come first)."""
    while True:
        byte = fh.read(1)
        if not byte:
            raise ImageHeaderError("JPEG ends before its start-of-frame marker")
        if byte != b"\xff":
            raise ImageHeaderError(f"JPEG marker expected at byte {fh.tell() - 1}")
        marker = fh.read(1)
        while marker == b"\xff":  # fill bytes
            marker = fh.read(1)
        if not marker:
            raise ImageHeaderError("JPEG ends inside a marker")
        code = marker[0]
        if code in _JPEG_STANDALONE:
            continue
        if code == 0xD9:
            raise ImageHeaderError("JPEG ends (EOI) before a start-of-frame marker")
        raw = fh.read(2)
        if len(raw) < 2:
            raise ImageHeaderError("JPEG ends inside a segment length")
        length = struct.unpack(">H", raw)[0]
        if length < 2:
            raise ImageHeaderError(f"JPEG segment with length {length}")
        if code in _JPEG_SOF:
            frame = fh.read(5)
            if len(frame) < 5:
                raise ImageHeaderError("JPEG ends inside its start-of-frame segment")
            height, width = struct.unpack(">HH", frame[1:5])
            return int(width), int(height)
        fh.seek(length - 2, os.SEEK_CUR)


def _pillow_size(path: str | os.PathLike | BinaryIO) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            return img.size
    except Image.DecompressionBombError as exc:
        raise ImageHeaderError(f"decompression bomb ({exc})") from exc
    except (UnidentifiedImageError, SyntaxError, ValueError) as exc:
        raise ImageHeaderError(f"not a readable image ({exc})") from exc
