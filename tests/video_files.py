"""Small videos written in the tests with PyAV: frame k is one flat colour known from k, so a
decoded frame tells which frame it is."""

from __future__ import annotations

from pathlib import Path

import numpy as np

# (container suffix, codec, pixel format)
FORMATS = {"mp4": ("libx264", "yuv420p"), "webm": ("libvpx-vp9", "yuv420p"),
           "mkv": ("libx264", "yuv420p"), "avi": ("mpeg4", "yuv420p")}


def frame_colour(k: int) -> tuple[int, int, int]:
    """The RGB colour of frame k: distinct for k < 64 and far apart after compression."""
    return (32 + 48 * (k % 4), 32 + 48 * (k // 4 % 4), 32 + 48 * (k // 16 % 4))


def frame_of(pixels: np.ndarray) -> int:
    """The frame index whose colour is nearest the mean colour of a decoded RGB frame."""
    mean = pixels.reshape(-1, 3).mean(0)
    return int(np.argmin([np.abs(mean - frame_colour(k)).sum() for k in range(64)]))


def write_video(path: Path, frames: int, fps: int = 10, size: tuple[int, int] = (64, 48),
                gop: int = 12) -> Path:
    """A video of `frames` flat-coloured frames (width x height `size`), in the format its
    suffix names."""
    import av

    codec, pix = FORMATS[path.suffix.lstrip(".")]
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = pix
        stream.codec_context.gop_size = gop
        for k in range(frames):
            img = np.empty((size[1], size[0], 3), np.uint8)
            img[:] = frame_colour(k)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path
