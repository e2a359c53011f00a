"""A sample's images and videos as its text and the vision encoder carry them: one rule for
`omnibal stats` and training, so the tiles and frames both count cannot disagree.

Each image is one placeholder with its tiles; an InternVL video is one placeholder per video
that the text spells out as its frames, each frame one image of one tile; a native-resolution
(Qwen2.5-VL) video is one placeholder whose units are its merge groups. Stats measures the tiles
from image headers and renders an InternVL video with one frame (data/video_lengths.py adds
each epoch's frames); training takes the tiles and each epoch's frames from the length file.
Both then render, count and check the same `SampleMedia`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from megatron_omnibal.data.images.tiling import TilingConfig
from megatron_omnibal.data.text import conversations as conv


def dataset_tiling(tiling: TilingConfig, max_tiles: int | None) -> TilingConfig:
    """The tiling of one dataset: InternVL's per-dataset max_dynamic_patch caps its tiles."""
    if max_tiles is None:
        return tiling
    return replace(tiling, max_tiles=max_tiles, min_tiles=min(tiling.min_tiles, max_tiles))


@dataclass(frozen=True)
class SampleMedia:
    """What a sample's placeholders become: `media` for the text (one per image or video, in
    order), `units` for the vision encoder (tiles per image, or per frame of an InternVL
    video; merge groups per native video)."""

    media: list[conv.Media]
    units: list[int]

    def vision(self, dummy_tile: int) -> tuple[int, int]:
        """(vit_num, image_flags): the real units, and the tiles the encoder runs (a sample
        without images or videos runs `dummy_tile` dummy tiles)."""
        real = sum(self.units)
        return (real if self.media else int(dummy_tile)), real


def sample_media(style: conv.ImageStyle, native: bool, image_tiles: Sequence[int],
                 video_units: Sequence[int]) -> SampleMedia:
    """The media of a sample with images of `image_tiles` tiles, or videos of `video_units`
    frames (InternVL) or merge groups (native) each."""
    if video_units and native:
        video = conv.video_style(style)
        return SampleMedia([conv.Media.native_video(video)] * len(video_units),
                           [int(n) for n in video_units])
    if video_units:
        if not (style.start and style.end):
            raise conv.SampleError("video samples need a model whose images have start and "
                                   "end tokens (InternVL); this one's have none")
        return SampleMedia([conv.Media.frames(int(n), style) for n in video_units],
                           [1] * int(sum(video_units)))
    return SampleMedia([conv.Media.image(style)] * len(image_tiles), [int(n) for n in image_tiles])
