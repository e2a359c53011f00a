"""Reading videos with PyAV: the header alone (for `omnibal stats`), or exactly a list of frames.

Why two readers: measuring a dataset must not decode its videos (a header read is
milliseconds), and the training loader must decode only the frames it trains on
(data/video/exact_decode.py), never the whole video. decord is not used: opening a file with
it reads every packet to build an index.

Frame counts: many containers (WebM/MKV, some MP4/TS) store no frame count (PyAV reports 0).
Their duration is no count either: it is the longest track's (an audio track may outlast the
video) on the container's clock, so duration x rate is often a frame off. The count is then
taken from the time of the stream's last packet (a seek to the last keyframe and a read of the
packets after it, none decoded), and the header says it is an estimate: a frame past the end of
an estimated count is the last frame, never a reason to call the file corrupt. Frame k is the
k-th frame in presentation order; its time is k / rate from the stream's start, which is how a
decoded frame is matched to k.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class VideoBytes:
    """A video held in memory (a member of a Megatron-Energon sample): its name, for messages
    (`str()` gives it), and its bytes, read by PyAV from memory."""

    name: str
    data: bytes = field(repr=False)

    def __str__(self) -> str:
        return self.name


VideoSource = str | os.PathLike | VideoBytes


def _where(source: VideoSource) -> str:
    return source.name if isinstance(source, VideoBytes) else os.fspath(source)


def _open(source: VideoSource):
    import io

    import av

    where = _where(source)
    if not isinstance(source, VideoBytes) and not os.path.isfile(where):
        raise VideoError(f"cannot open video {where}: no such file")
    try:
        container = av.open(io.BytesIO(source.data) if isinstance(source, VideoBytes)
                            else where)
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise VideoError(f"cannot open video {where}: {exc}") from exc
    if not container.streams.video:
        container.close()
        raise VideoError(f"video {where} has no video stream")
    return container


def _header(container, where: str, count_tail: bool = True) -> VideoHeader:
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
        estimated = True
        tail = _tail_frames(container, stream, fps, duration) if count_tail and fps else None
        frames = tail if tail is not None else int(duration * fps + 1e-6)
    if not duration and fps:
        duration = frames / fps
    if frames <= 0 or fps <= 0:
        raise VideoError(f"video {where}: the header gives no frame count and no duration x "
                         f"frame rate (frames {stream.frames}, rate {fps}, duration {duration})")
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width <= 0 or height <= 0:
        raise VideoError(f"video {where}: the header gives no frame size")
    return VideoHeader(frames, fps, duration, width, height, estimated)


def _tail_frames(container, stream, fps: float, duration: float) -> int | None:
    """Frames up to the stream's last packet (its time x rate, + 1): a seek to the last
    keyframe and the packets after it read, none decoded. None when no packet has a time.

    Why: a container without a frame count (Matroska, WebM) has only a duration, and that is
    the longest stream's (an audio track may outlast the video) rounded to the container's
    clock; duration x rate is then a frame too many or too few."""
    import av

    base, tb = stream.start_time or 0, float(stream.time_base)
    try:
        container.seek(base + int(max(duration, 1.0) * 2 / tb), stream=stream, backward=True)
    except av.FFmpegError:
        return None
    last = None
    for packet in container.demux(stream):
        at = packet.pts if packet.pts is not None else packet.dts
        if packet.size and at is not None:
            last = at if last is None else max(last, at)
    return None if last is None else int(round((last - base) * tb * fps)) + 1


def read_header(path: VideoSource) -> VideoHeader:
    """The header of the video at `path`, without decoding a frame."""
    import av

    where = _where(path)
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


def decode_frames(path: VideoSource, indices: list[int] | np.ndarray) -> DecodedFrames:
    """The frames `indices` (repeats allowed, any order) of the video at `path`.

    Exactly the frames any exact decoder must decode are decoded (data/video/exact_decode.py): for
    each wanted frame, those from the later of its keyframe and the previous wanted frame,
    frames nothing refers to (B-frames) left out unless wanted. A frame index no frame's time
    maps to (variable-rate video) gets the frame shown at that time: the last one before it.
    A frame count the container does not store is an estimate: wanted frames past the last
    frame that decodes get the last frame (the one shown then). A video that ends before a
    wanted frame of the count its header stores, or whose data is corrupt, is a VideoError.
    """
    import av

    from megatron_omnibal.data.video.exact_decode import ExactDecoder

    where = _where(path)
    wanted = sorted({int(i) for i in indices})
    if not wanted:
        raise ValueError(f"video {where}: no frame asked for")
    container = _open(path)
    try:
        header = _header(container, where, count_tail=False)
        if wanted[0] < 0 or (wanted[-1] >= header.frames and not header.estimated):
            raise VideoError(f"video {where}: frame {wanted[-1] if wanted[0] >= 0 else wanted[0]}"
                             f" asked for, the header says {header.frames} frames")
        decoder = ExactDecoder(container, header.fps, where)
        got = decoder.run(wanted)
        if decoder.redo:  # a gap's frame was dropped undecoded: again, dropping nothing
            again = ExactDecoder(container, header.fps, where, drop=False)
            got = again.run(wanted)
            decoder.decoded += again.decoded
        _check_end(decoder, header, wanted, where)
    except av.FFmpegError as exc:
        raise VideoError(f"video {where} fails while decoding: {exc}") from exc
    finally:
        container.close()
    return DecodedFrames(np.stack([got[int(i)] for i in indices]), decoder.decoded)


def _check_end(decoder, header: VideoHeader, wanted: list[int], where: str) -> None:
    """A video whose stored frame count (and duration) promise frames past its last one is
    truncated or corrupt; an estimated count promises nothing."""
    if header.estimated or decoder.last_at >= wanted[-1]:
        return
    if (decoder.last_at + 1.5) / header.fps < header.duration:
        raise VideoError(f"video {where} ends after frame {decoder.last_at} of the "
                         f"{header.frames} its header promises (frame {wanted[-1]} wanted): "
                         "truncated or corrupt")


def count_frames(path: VideoSource) -> int:
    """Frames of the video at `path` that decode: the last frame's index + 1, found by
    decoding from the last keyframe to the end (the count `--verify-images` trusts where the
    container stores none)."""
    import av

    where = _where(path)
    container = _open(path)
    try:
        header = _header(container, where, count_tail=False)
        stream = container.streams.video[0]
        base, tb = stream.start_time or 0, float(stream.time_base)
        container.seek(base + int(max(header.duration, 1.0) * 2 / tb), stream=stream,
                       backward=True)
        last = None
        for frame in container.decode(stream):
            if frame.pts is not None:
                at = int(round((frame.pts - base) * tb * header.fps))
                last = at if last is None else max(last, at)
    except av.FFmpegError as exc:
        raise VideoError(f"video {where} fails while decoding: {exc}") from exc
    finally:
        container.close()
    if last is None:
        raise VideoError(f"video {where}: no frame decodes after its last keyframe")
    return last + 1
