"""Which frames of a video a sample trains on, per epoch: pure numpy, the same on every rank.

InternVL's fine-tuning draws a frame count uniformly in [min_frames, max_frames] per video per
epoch (defaults 8 and 32), then picks the frames by a sampling rule:
- 'rand': [0, frames) is cut into `count` equal segments, one random frame from each;
- 'middle': the middle frame of each segment;
- 'fpsX' (e.g. 'fps0.5'): one frame every 1/X seconds at the middle of each period; the count
  follows from the duration (capped at max_frames), not from a draw.
A video with fewer frames than the count repeats its last frame up to the count, as InternVL
does, so the count (the tiles and tokens of the sample) never depends on the video's length
under 'rand' and 'middle'.

Here the count is decided ahead of the epoch from (seed, epoch) alone, so the balancer and the
planner know every sample's tiles and tokens before the epoch starts, every rank computes the
same counts, and a resumed run the same again. The frames are drawn in the loader that decodes
them, from (seed, epoch, sample, video). Each draw has its own random stream, spawned from
(seed, epoch) with a key naming what is drawn: the counts, or the frames of one video of one
sample; so no two videos share frames by accident and no sample's frames repeat the counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

SAMPLINGS = ("rand", "middle", "fpsX")
_FPS = re.compile(r"fps(\d+(?:\.\d+)?)$")
_COUNT_STREAM, _FRAME_STREAM = 0, 1  # the first word of each draw's spawn key


def _stream(seed: int, epoch: int, *key: int) -> np.random.Generator:
    """The random stream of one draw of (seed, epoch): `key` says which."""
    return np.random.default_rng(np.random.SeedSequence([seed, epoch], spawn_key=key))


@dataclass(frozen=True, kw_only=True)
class FrameSettings:
    """Frames per video: the count range and the sampling rule ('rand', 'middle', 'fpsX')."""

    min_frames: int = 8
    max_frames: int = 32
    sampling: str = "rand"

    def __post_init__(self) -> None:
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"frames: need 1 <= min_frames <= max_frames, got "
                             f"{self.min_frames} and {self.max_frames}")
        if self.sampling not in ("rand", "middle") and self.fps is None:
            raise ValueError(f"frame sampling {self.sampling!r}: expected rand, middle or fpsX "
                             "(X frames per second, e.g. fps0.5)")

    @property
    def fps(self) -> float | None:
        """The X of 'fpsX' (None for the other rules)."""
        match = _FPS.match(self.sampling)
        value = float(match.group(1)) if match else None
        return value if value else None


def clip_start(clip: tuple[float, float] | None, fps: float) -> int:
    """The first frame of a clip [start_s, end_s] (InternVL: int(start x rate))."""
    return 0 if clip is None else int(clip[0] * fps)


def frame_counts(settings: FrameSettings, frames: np.ndarray, fps: np.ndarray, seed: int,
                 epoch: int) -> np.ndarray:
    """Frames trained of each video (int64 [videos]) in `epoch`, from the videos' available
    `frames` and frame rates `fps` (both per video, in length-file order)."""
    n = len(frames)
    if settings.fps is not None:
        duration = np.asarray(frames, np.float64) / np.maximum(np.asarray(fps, np.float64), 1e-9)
        # the periods whose middle lies inside the video (frame_indices picks those)
        count = np.ceil(duration * settings.fps - 0.5 - 1e-9).astype(np.int64)
        return np.clip(count, 1, settings.max_frames)
    if settings.min_frames == settings.max_frames:
        return np.full(n, settings.min_frames, np.int64)
    rng = _stream(seed, epoch, _COUNT_STREAM)
    return rng.integers(settings.min_frames, settings.max_frames + 1, size=n, dtype=np.int64)


def frame_indices(settings: FrameSettings, count: int, frames: int, fps: float, seed: int,
                  epoch: int, sample: int, video: int) -> np.ndarray:
    """The `count` frame indices (int64, ascending, repeats at the end of a short video) that
    sample `sample` trains in `epoch` of its video `video` (its row in the length file's video
    table), which has `frames` frames at `fps` frames/s."""
    if count <= 0 or frames <= 0:
        raise ValueError(f"frame_indices: count {count} of {frames} frames")
    if settings.fps is not None:
        delta = 1.0 / settings.fps
        times = np.arange(delta / 2, frames / fps, delta)[:count]
        picked = np.minimum(np.round(times * fps).astype(np.int64), frames - 1)
    else:
        segments = min(count, frames)
        edges = np.linspace(0, frames, segments + 1).astype(np.int64)
        low, high = edges[:-1], edges[1:]
        if settings.sampling == "middle":
            picked = (low + high) // 2
        else:
            rng = _stream(seed, epoch, _FRAME_STREAM, sample, video)
            picked = low + np.floor(rng.random(segments) * (high - low)).astype(np.int64)
    if len(picked) < count:
        picked = np.concatenate([picked, np.full(count - len(picked), picked[-1], np.int64)])
    return picked.astype(np.int64)
