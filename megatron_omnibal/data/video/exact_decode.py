"""Decode the wanted frames of a video and no frame more than an exact decoder must.

The bound: for each wanted frame (in presentation order), the frames from the later of its
keyframe and the previous wanted frame, less the frames nothing refers to (B-frames) that are
not wanted. A decoder that seeks on a guess of the keyframe interval decodes more: it decodes on
through a keyframe it could have restarted at, or seeks back to a keyframe it already passed.

So this decoder reads packets ahead of the decoder (reading a packet is cheap, decoding it is
not) and decides per packet, in decode order:
- a keyframe with no wanted frame before it still to come: the packets read since the last
  decision are never needed and are dropped; the frames still inside the decoder come out
  (drained) and decoding restarts at the keyframe;
- a wanted frame's packet: the packets kept since the last decision are decoded, those nothing
  refers to dropped undecoded;
- the next wanted frame lies more than a second ahead and the container's index names a
  keyframe before it beyond what was read: seek there instead of reading on.
A wanted index that no frame's time maps to (variable-rate video, or past the end of a video
whose frame count is an estimate) gets the frame shown at that time: the last one before it.
"""

from __future__ import annotations

import sys
from bisect import bisect_left, bisect_right

import numpy as np

_MAX_REORDER = 16  # frames a decode-order timestamp can lag its presentation (H.264's limit)


def _in_loader_worker() -> bool:
    """Whether this process is a torch DataLoader worker (FFmpeg's automatic thread count is
    every core, in every worker: 8 workers on a 64-core node would run 512 decoder threads)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


class ExactDecoder:
    """`run(wanted)` -> {frame index: RGB uint8 [H, W, 3]}; `decoded` counts the frames the
    codec decoded, `last_at` the index of the last frame seen (for the end-of-video check);
    `redo` says a gap's frame was dropped undecoded (run again with `drop=False`)."""

    def __init__(self, container, fps: float, where: str, drop: bool = True) -> None:
        stream = container.streams.video[0]
        if _in_loader_worker():  # the workers are the parallelism: one thread each
            stream.codec_context.thread_count = 1
        else:
            stream.thread_type = "AUTO"
        self.container, self.stream, self.context = container, stream, stream.codec_context
        self.fps, self.where, self.drop = fps, where, drop
        self.base, self.tb = stream.start_time or 0, float(stream.time_base)
        self.decoded, self.redo, self.last_at = 0, False, -1
        self.got: dict[int, np.ndarray] = {}
        self.last = None  # the last frame out of the decoder
        self.fed = False  # packets decoded since the decoder was last reset
        self.dropped: list[int] = []  # indices of packets dropped undecoded
        self.shift = 0  # the largest presentation - decode timestamp seen (stream units)

    def _index(self, ts: int) -> int:
        return int(round((ts - self.base) * self.tb * self.fps))

    def _at(self, packet) -> int | None:
        if packet.pts is not None and packet.dts is not None:
            self.shift = max(self.shift, packet.pts - packet.dts)
        ts = packet.pts if packet.pts is not None else packet.dts
        return None if ts is None else self._index(ts)

    def run(self, wanted: list[int]) -> dict[int, np.ndarray]:
        """The frames `wanted` (ascending, distinct)."""
        self.wanted, self.want, self.unfed = wanted, set(wanted), set(wanted)
        self._seek(self.base + int(max(0.0, (wanted[0] - 0.5 - _MAX_REORDER) / self.fps)
                                   / self.tb), -1)
        buffer: list = []  # packets read and not decoded since the last decision
        while len(self.got) < len(wanted):
            packet = next(self.packets, None)
            if packet is None or (not packet.size and packet.pts is None and packet.dts is None):
                self._feed(buffer, final=True)
                self._drain(None)
                break
            if not packet.size:
                continue
            at = self._at(packet)
            if at is not None:
                self.read_at = max(self.read_at, at)
            if packet.is_keyframe and at is not None and (buffer or self.fed):
                if any(w < at for w in self.unfed):  # a leading frame of an open GOP, a gap
                    self._feed(buffer, whole=True)
                else:
                    self._drain(at)
                buffer = []
            buffer.append(packet)
            if at in self.unfed:
                self._feed(buffer)
                buffer = []
                if not self.unfed:  # every wanted frame decoded: out of the decoder with them
                    self._drain(None)
                    break
                self._skip_ahead()
        return self.got

    def _seek(self, ts: int, read_at: int) -> None:
        self.container.seek(ts, stream=self.stream, backward=True)
        self.packets = self.container.demux(self.stream)
        self.read_at = read_at

    def _skip_ahead(self) -> None:
        """Seek to the keyframe before the next wanted frame when it lies more than a second
        past what was read and the container's index names it."""
        if not self.unfed or min(self.unfed) <= self.read_at + max(self.fps, 1.0):
            return
        entries = self.stream.index_entries
        target = self.base + int((min(self.unfed) - 0.5 - _MAX_REORDER) / self.fps / self.tb) \
            - self.shift
        found = entries.search_timestamp(target, backward=True) if len(entries) else -1
        if found < 0 or not entries[found].is_keyframe:
            return
        key = entries[found].timestamp
        if self._index(key) > self.read_at + 1:
            self._drain(self._index(key))
            self._seek(key, self.read_at)

    def _feed(self, buffer: list, final: bool = False, whole: bool = False) -> None:
        """Decode `buffer` up to its last packet needed (`whole`: all of it, as decoding goes
        on after it): the packets nothing refers to are dropped undecoded unless their frame is
        wanted or may be the one shown at a wanted time no frame starts at (one the buffer
        reads past, or any at the `final` end)."""
        if not buffer:
            return
        at = [self._at(p) for p in buffer]
        keep = {i for i, a in enumerate(at) if a in self.unfed}
        times = sorted((a, i) for i, a in enumerate(at) if a is not None)
        past = max((a for a in at if a is not None), default=-1)
        for w in self.unfed:
            if w >= past and not final:
                continue
            k = bisect_right(times, (w, len(buffer))) - 1
            if k >= 0 and times[k][0] > self.last_at:
                keep.add(times[k][1])
        end = len(buffer) if whole else max(keep, default=-1) + 1
        for i, packet in enumerate(buffer[:end]):
            kept = not self.drop or at[i] is None or packet.is_keyframe or i in keep
            if not kept:
                self.dropped.append(at[i])
            self.context.skip_frame = "DEFAULT" if kept else "NONREF"
            for frame in self.context.decode(packet):
                self._emit(frame)
            self.unfed.discard(at[i])
            self.fed = True

    def _drain(self, upto: int | None) -> None:
        """The frames still in the decoder come out; the wanted frames before `upto` (all, at
        the end) take the last frame; the decoder is reset for a restart at a keyframe."""
        if self.fed:
            for frame in self.context.decode(None):
                self._emit(frame)
            self.context.flush_buffers()
            self.fed = False
        self._resolve(upto)
        if upto is not None:
            self.last_at = max(self.last_at, upto - 1)

    def _emit(self, frame) -> None:
        self.decoded += 1
        at = self._index(frame.pts) if frame.pts is not None else self.last_at + 1
        self._resolve(at, frame)
        if at in self.want and at not in self.got:
            self.got[at] = frame.to_ndarray(format="rgb24")
            self.unfed.discard(at)
        self.last, self.last_at = frame, max(self.last_at, at)

    def _resolve(self, upto: int | None, after=None) -> None:
        """Wanted frames after the last frame out and before `upto` (no frame starts at their
        time) take the last frame out (the one shown then); `after` when there is none yet
        (the seek landed past them)."""
        low = bisect_right(self.wanted, self.last_at)
        high = len(self.wanted) if upto is None else bisect_left(self.wanted, upto)
        for w in self.wanted[low:high]:
            if w in self.got:
                continue
            if any(self.last_at < d <= w for d in self.dropped):
                self.redo = True
            shown = self.last if self.last is not None else after
            if shown is not None:
                self.got[w] = shown.to_ndarray(format="rgb24")
                self.unfed.discard(w)
