"""Small videos written in the tests with PyAV: frame k is one flat colour known from k, so a
decoded frame tells which frame it is."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_omnibal.data.formats import generate

# container suffix -> codec
CODECS = {"mp4": "libx264", "webm": "libvpx-vp9", "mkv": "libx264", "avi": "mpeg4"}


def frame_colour(k: int) -> tuple[int, int, int]:
    """The RGB colour of frame k: distinct for k < 64 and far apart after compression."""
    return (32 + 48 * (k % 4), 32 + 48 * (k // 4 % 4), 32 + 48 * (k // 16 % 4))


def frame_of(pixels: np.ndarray) -> int:
    """The frame index whose colour is nearest the mean colour of a decoded RGB frame."""
    mean = pixels.reshape(-1, 3).mean(0)
    return int(np.argmin([np.abs(mean - frame_colour(k)).sum() for k in range(64)]))


def write_video(path: Path, frames: int, fps: int = 10, size: tuple[int, int] = (64, 48),
                gop: int = 12, times: list[int] | None = None,
                container_options: dict[str, str] | None = None,
                options: dict[str, str] | None = None) -> Path:
    """A video of `frames` flat-coloured frames (width x height `size`), in the format its
    suffix names (`times`: each frame's time in 1/fps units, for a variable rate; `options`:
    the encoder's)."""

    def picture(k: int) -> np.ndarray:
        img = np.empty((size[1], size[0], 3), np.uint8)
        img[:] = frame_colour(k)
        return img

    return generate.write_video(path, CODECS[path.suffix.lstrip(".")], frames, fps, size, gop,
                                picture, options, times=times,
                                container_options=container_options)


def add_audio(path: Path, seconds: float) -> Path:
    """`path` remuxed with a silent audio track of `seconds` (Opus in WebM, AAC otherwise), so
    the container's duration is the longer of the two tracks'."""
    import av

    tmp = path.with_name("noaudio_" + path.name)
    path.rename(tmp)
    codec = "libopus" if path.suffix == ".webm" else "aac"
    with av.open(str(tmp)) as src, av.open(str(path), "w") as out:
        video = out.add_stream_from_template(src.streams.video[0])
        audio = out.add_stream(codec, rate=48000, layout="mono")
        for packet in src.demux(src.streams.video[0]):
            if packet.size:  # (not the demuxer's closing empty packet)
                packet.stream = video
                out.mux(packet)
        step = 960
        for start in range(0, int(seconds * 48000), step):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, step), np.float32),
                                               format="flt" if codec == "libopus" else "fltp",
                                               layout="mono")
            frame.sample_rate, frame.pts = 48000, start
            out.mux(audio.encode(frame))
        out.mux(audio.encode())
    tmp.unlink()
    return path
