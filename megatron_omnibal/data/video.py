"""Reading videos with PyAV: the header alone (for `omnibal stats`), or exactly a list of frames.

Why two readers: measuring a dataset must not decode its videos (a header read is
milliseconds), and the training loader must decode only the frames it trains on, seeking to
them, never the whole video. decord is not used: opening a file with it reads every packet to
build an index.

Frame counts: many containers (WebM/MKV, some MP4/TS) store no frame count (PyAV reports 0);
the count is then estimated from the stream's (else the container's) duration times its frame
rate, and the header says it is an estimate. Frame k is the k-th frame in presentation order;
its time is k / rate from the stream's start, which is how a decoded frame is matched to k.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np


class VideoError(ValueError):
    """A video that cannot be read: cannot be opened, has no video stream, or fails while
    decoding (a truncated or corrupt file). The message names the file and the reason."""


@dataclass(frozen=True)
class VideoHeader:
    """What a video's header says: frames available, rate (frames/s), duration (s), size."""

    frames: int
    fps: float
    duration: float
    width: int
    height: int
    estimated: bool  # `frames` is duration x rate, the container stores no count


def _rate(value: object) -> float:
    """A stream rate as float; PyAV gives Fraction, AVRational (0/0 is NaN) or None."""
    if value is None:
        return 0.0
    try:
        rate = float(value)
    except (ZeroDivisionError, TypeError, ValueError):
        return 0.0
    return rate if math.isfinite(rate) and rate > 0 else 0.0


def _open(path: str | os.PathLike):
    import av

    where = os.fspath(path)
    if not os.path.isfile(where):
        raise VideoError(f"cannot open video {where}: no such file")
    try:
        container = av.open(where)
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise VideoError(f"cannot open video {where}: {exc}") from exc
    if not container.streams.video:
        container.close()
        raise VideoError(f"video {where} has no video stream")
    return container


def _header(container, where: str) -> VideoHeader:
    stream = container.streams.video[0]
    fps = _rate(stream.average_rate) or _rate(stream.guessed_rate) or _rate(stream.base_rate)
    if stream.duration is not None and stream.time_base is not None:
        duration = float(stream.duration * stream.time_base)
    elif container.duration is not None:
        duration = container.duration / 1_000_000
    else:
        duration = 0.0
    frames, estimated = int(stream.frames or 0), False
    if frames <= 0:
        frames, estimated = int(duration * fps + 1e-6), True
    if not duration and fps:
        duration = frames / fps
    if frames <= 0 or fps <= 0:
        raise VideoError(f"video {where}: the header gives no frame count and no duration x "
                         f"frame rate (frames {stream.frames}, rate {fps}, duration {duration})")
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width <= 0 or height <= 0:
        raise VideoError(f"video {where}: the header gives no frame size")
    return VideoHeader(frames, fps, duration, width, height, estimated)


def read_header(path: str | os.PathLike) -> VideoHeader:
    """The header of the video at `path`, without decoding a frame."""
    import av

    where = os.fspath(path)
    container = _open(path)
    try:
        return _header(container, where)
    except av.FFmpegError as exc:
        raise VideoError(f"cannot read the header of video {where}: {exc}") from exc
    finally:
        container.close()


@dataclass
class DecodedFrames:
    """RGB frames [n, H, W, 3] uint8 in the order asked, and how many frames were decoded."""

    pixels: np.ndarray
    decoded: int


def decode_frames(path: str | os.PathLike, indices: list[int] | np.ndarray) -> DecodedFrames:
    """The frames `indices` (repeats allowed, any order) of the video at `path`.

    Frames are decoded in order from the keyframe before each wanted frame: the decoder seeks
    when the next wanted frame lies further ahead than the longest keyframe interval seen so
    far (at first: one second), else decodes on, since a seek would land on a keyframe it has
    already passed. Frames no other frame refers to (B-frames) are skipped unless wanted. A
    frame index no frame's time maps to (variable-rate video) gets the frame shown at that
    time: the last one before it.
    A video that ends before a wanted frame the header promised, or whose data is corrupt, is
    a VideoError.
    """
    import av

    where = os.fspath(path)
    wanted = sorted({int(i) for i in indices})
    if not wanted:
        raise ValueError(f"video {where}: no frame asked for")
    container = _open(path)
    try:
        header = _header(container, where)
        if wanted[0] < 0 or wanted[-1] >= header.frames:
            raise VideoError(f"video {where}: frame {wanted[-1] if wanted[0] >= 0 else wanted[0]}"
                             f" asked for, the header says {header.frames} frames")
        got, decoded = _decode(container, header, wanted, where)
    except av.FFmpegError as exc:
        raise VideoError(f"video {where} fails while decoding: {exc}") from exc
    finally:
        container.close()
    return DecodedFrames(np.stack([got[int(i)] for i in indices]), decoded)


def _decode(container, header: VideoHeader, wanted: list[int],
            where: str) -> tuple[dict[int, np.ndarray], int]:
    stream = container.streams.video[0]
    stream.thread_type = "AUTO"
    base = stream.start_time or 0
    tb = float(stream.time_base)
    want = set(wanted)

    def index(pts: int) -> int:
        return int(round((pts - base) * tb * header.fps))

    got: dict[int, np.ndarray] = {}
    decoded, position, frames = 0, -1, None
    shown, shown_at, dropped = None, -1, []  # the last frame at or before the target
    gap = max(1, int(round(header.fps)))  # the longest keyframe interval seen (at first 1 s)
    last_key = None
    for target in wanted:
        while target not in got:
            if frames is None or target > position + gap:
                # the keyframe at or before the target, at the target's time less half a frame
                seconds = max(0.0, (target - 0.5) / header.fps)
                container.seek(base + int(seconds / tb), stream=stream, backward=True)
                position, last_key, shown, shown_at, dropped = -1, None, None, -1, []
                frames = _frames(container, stream, index, want, dropped)
            while position < target:
                frame = next(frames, None)
                if frame is None:
                    raise VideoError(f"video {where} ends after frame {position} of the "
                                     f"{header.frames} its header promises (frame {target} "
                                     "wanted): truncated or corrupt")
                decoded += 1
                at = index(frame.pts) if frame.pts is not None else position + 1
                position = max(position, at)
                if at <= target:
                    shown, shown_at = frame, at
                if frame.key_frame:
                    gap = max(gap, position - last_key) if last_key is not None else gap
                    last_key = position
                if position in got or position not in want:
                    continue
                got[position] = frame.to_ndarray(format="rgb24")
            if target in got:
                break
            # no frame has that time (a variable rate): the one shown then is the last one
            # before it; if that one was dropped undecoded, decode again and keep it
            passed = [i for i in dropped if shown_at < i <= target]
            if passed:
                want.update(passed)
                frames = None
            else:  # (the first one after it when the seek landed past it)
                got[target] = (shown or frame).to_ndarray(format="rgb24")
    return got, decoded


def _frames(container, stream, index, want: set[int], dropped: list[int]):
    """The stream's frames from the container's position; a packet nothing refers to (a
    B-frame) is dropped undecoded unless its frame is wanted (the index of each packet that
    may be dropped is added to `dropped`)."""
    context = stream.codec_context
    for packet in container.demux(stream):
        keep = packet.pts is None or packet.is_keyframe or index(packet.pts) in want
        if not keep:
            dropped.append(index(packet.pts))
        context.skip_frame = "DEFAULT" if keep else "NONREF"
        yield from packet.decode()
