"""The tiles and tokens of video samples in each epoch: pure numpy over the length file.

A length record holds a sample's tiles and tokens as `omnibal stats` counted them, for the frame
counts of epoch 0 of its frame seed. Each video of the dataset is also listed in a video table
(its sample, the frames its header says it has, its frame rate, the frames counted), and the
stats configuration says how counts are drawn (data/frames.py) and how many tokens frame k of a
video adds (its label `\\nFrame{k}: `, the image start/end tokens, the image tokens). From those,
any epoch's lengths follow without opening a file: each frame is one tile and one image.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from megatron_omnibal.data.frames import FrameSettings, frame_counts
from megatron_omnibal.data.lengths import (
    LengthsError,
    LengthStats,
    VideoTable,
    load_lengths,
    load_videos,
    read_stats_config,
)


@dataclass(frozen=True, kw_only=True)
class VideoPlan:
    """How frame counts are drawn and what each frame costs in tokens."""

    frames: FrameSettings
    frame_tokens: tuple[int, ...]  # [k-1]: tokens frame k adds (k >= 2; [0] is frame 1's)
    seed: int = 0  # the seed the length records' counts were drawn with (epoch 0)

    def __post_init__(self) -> None:
        if len(self.frame_tokens) < self.frames.max_frames:
            raise ValueError(f"frame_tokens has {len(self.frame_tokens)} entries, the frame "
                             f"range goes to {self.frames.max_frames}")

    def video_tokens(self, counts: np.ndarray) -> np.ndarray:
        """Tokens of videos of `counts` frames (labels, image marks and image tokens)."""
        cumulative = np.concatenate([[0], np.cumsum(self.frame_tokens)]).astype(np.int64)
        return cumulative[np.asarray(counts, np.int64)]


def with_frame_counts(lengths: LengthStats, table: VideoTable, plan: VideoPlan,
                      counts: np.ndarray) -> LengthStats:
    """The length records with video j trained on counts[j] frames instead of table.tiles[j]."""
    tiles = np.bincount(table.sample, counts - table.tiles, len(lengths)).astype(np.int64)
    tokens = np.bincount(table.sample, plan.video_tokens(counts) - plan.video_tokens(table.tiles),
                         len(lengths)).astype(np.int64)
    return LengthStats(lengths.vit + tiles, lengths.tokens + tokens,
                       lengths.image_flags + tiles, lengths.dataset, lengths.names)


class EpochLengths:
    """`lengths_of_epoch(epoch)`: a run's length records of each epoch (balance seed `seed`).

    The last epoch asked for is kept: the loader asks once per sample.
    """

    def __init__(self, lengths: LengthStats, table: VideoTable, plan: VideoPlan | None,
                 seed: int) -> None:
        self.lengths, self.table, self.plan, self.seed = lengths, table, plan, seed
        self._last: tuple[int, LengthStats, np.ndarray] | None = None

    def _epoch(self, epoch: int) -> tuple[LengthStats, np.ndarray]:
        if self.plan is None:
            return self.lengths, self.table.tiles
        if self._last is None or self._last[0] != epoch:
            counts = frame_counts(self.plan.frames, self.table.frames, self.table.fps,
                                  self.seed, epoch)
            self._last = (epoch, with_frame_counts(self.lengths, self.table, self.plan, counts),
                          counts)
        return self._last[1], self._last[2]

    def __call__(self, epoch: int) -> LengthStats:
        return self._epoch(epoch)[0]

    def frame_counts(self, epoch: int) -> np.ndarray:
        """Frames of each video of the table in `epoch` (int64 [videos])."""
        return self._epoch(epoch)[1]


def run_lengths(path: str | os.PathLike, lengths: LengthStats, seed: int) -> EpochLengths:
    """The lengths of each epoch of a run balancing `lengths` (read from the length file at
    `path`) with balance seed `seed`: a file with videos redraws their frames every epoch."""
    table, plan = load_video_plan(path)
    if plan is not None:
        counted = load_lengths(path)
        if not (np.array_equal(counted.tokens, lengths.tokens)
                and np.array_equal(counted.vit, lengths.vit)):
            raise LengthsError(f"{path} holds videos, whose frames are drawn per epoch from the "
                               "lengths as counted: train it at the tokens per tile it was "
                               "counted with and without a text scale")
    return EpochLengths(lengths, table, plan, seed)


def load_video_plan(path: str | os.PathLike) -> tuple[VideoTable, VideoPlan | None]:
    """The video table of a length file and its plan (None: the file has no video, or its
    videos are a native-resolution model's, whose frames are the same every epoch)."""
    table = load_videos(path)
    if not len(table):
        return table, None
    doc = read_stats_config(path) or {}
    if (doc.get("tiling") or {}).get("mode") == "native":  # Qwen2.5-VL: fixed every epoch
        return table, None
    try:
        plan = VideoPlan(frames=FrameSettings(**doc["frames"]),
                         frame_tokens=tuple(int(n) for n in doc["frame_tokens"]),
                         seed=int(doc["frame_seed"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise LengthsError(f"{path}: videos without the frame settings and per-frame token "
                           f"costs of `omnibal stats` ({type(exc).__name__}: {exc})") from exc
    return table, plan
