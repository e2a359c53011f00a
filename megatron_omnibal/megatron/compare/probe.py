"""Probe inputs for checking a converted model: a few samples laid out as the model's processor
lays them out (InternVL: `<img>` + context tokens + `</img>` per image; LLaVA: one token per
patch), with random pixels, an image over several tiles, a video (frames of one tile each with
their labels between them, as InternVL's processor lists them) and a text-only sample. For a
native-resolution model (Qwen2.5-VL): images of odd grid sizes (windows cut short at the edges),
two images in one sample, a text-only sample and a sample of two videos.

Why random: a numeric comparison of two implementations of the same function needs inputs that
exercise every path (several tiles, InternVL's dummy tile, packing), not meaningful ones.
"""

from __future__ import annotations

import torch

from megatron_omnibal.megatron.stream.batch import IGNORE_INDEX, Sample
from megatron_omnibal.models.spec import ModelSpec


def probe_samples(spec: ModelSpec, seed: int = 0, dummy_tile: bool = True) -> list[Sample]:
    """Four samples: an image of 2 tiles, an image of 1 tile, a video of 3 one-tile frames
    (random text stands for the `FrameK: ` labels), text only (with a dummy tile when
    `dummy_tile`, as InternVL trains text-only samples). Token 0 opens each sample."""
    g = torch.Generator().manual_seed(seed)
    if spec.vit.native_resolution:
        return _native_samples(spec, g)
    special = {spec.image_token_id, spec.image_start_id, spec.image_end_id, 0}
    allowed = torch.tensor([i for i in range(min(spec.llm.vocab_size, 1000)) if i not in special])

    def text(n: int) -> list[int]:
        return allowed[torch.randint(0, len(allowed), (n,), generator=g)].tolist()

    def image(tiles: int) -> list[int]:
        ids = [spec.image_token_id] * (spec.tokens_per_tile * tiles)
        if spec.image_start_id >= 0:
            ids = [spec.image_start_id, *ids]
        if spec.image_end_id >= 0:
            ids = [*ids, spec.image_end_id]
        return ids

    size = spec.vit.image_size
    out = []
    for tiles, words in ((2, 5), (1, 9)):
        ids = [0, *text(3), *image(tiles), *text(words)]
        out.append(_sample(ids, torch.randn(tiles, 3, size, size, generator=g), tiles))
    frames = 3
    ids = [0, *text(2)]
    for _ in range(frames):
        ids += [*text(3), *image(1)]
    ids += text(4)
    out.append(_sample(ids, torch.randn(frames, 3, size, size, generator=g), frames))
    ids = [0, *text(10)]  # an odd total length: sequence parallelism must pad
    dummy = int(dummy_tile)
    out.append(_sample(ids, torch.randn(dummy, 3, size, size, generator=g), 0))
    return out


def _sample(ids: list[int], images: torch.Tensor, real: int) -> Sample:
    flags = torch.zeros(len(images), dtype=torch.int64)
    flags[:real] = 1
    return Sample(
        tokens=torch.tensor(ids),
        labels=torch.full((len(ids),), IGNORE_INDEX),
        images=images,
        image_flags=flags,
    )


def _native_samples(spec: ModelSpec, g: torch.Generator) -> list[Sample]:
    """Image grids (t, h, w in patches) of 6x10 (one sample), 4x4 and 2x6 (one sample), 8x12,
    a text-only sample, and two videos in one sample: 3 temporal patches of 4x6 and one of 2x2,
    1.25 s per temporal patch (fractional M-RoPE time steps); each image or video is
    `<vision_start>` + placeholders + `<vision_end>`. A Qwen3-VL tower (a position table) takes
    a video as one (1, h, w) grid per temporal patch with text between them (its timestamps),
    as its processor splits it."""
    v = spec.vit
    special = {spec.image_token_id, spec.image_start_id, spec.image_end_id, 0}
    allowed = torch.tensor([i for i in range(min(spec.llm.vocab_size, 1000)) if i not in special])
    merge = v.spatial_merge_size * v.spatial_merge_size

    def text(n: int) -> list[int]:
        return allowed[torch.randint(0, len(allowed), (n,), generator=g)].tolist()

    out = []
    for grids, seconds in (([(1, 6, 10)], 0.0), ([(1, 4, 4), (1, 2, 6)], 0.0), ([], 0.0),
                           ([(1, 8, 12)], 0.0), ([(3, 4, 6), (1, 2, 2)], 1.25)):
        if v.num_position_embeddings:  # Qwen3-VL: a video is one grid per temporal patch
            grids = [(1, h, w) for t, h, w in grids for _ in range(t)]
        ids = [0, *text(3)]
        for t, h, w in grids:
            ids += [spec.image_start_id, *[spec.image_token_id] * (t * h * w // merge),
                    spec.image_end_id, *text(2)]  # fmt: skip
        ids += text(7)
        patches = sum(t * h * w for t, h, w in grids)
        out.append(Sample(
            tokens=torch.tensor(ids),
            labels=torch.full((len(ids),), IGNORE_INDEX),
            images=torch.randn(patches, v.patch_dim, generator=g),
            image_flags=torch.ones(len(grids), dtype=torch.int64),
            image_grid=torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
            grid_seconds=torch.full((len(grids),), seconds),
        ))  # fmt: skip
    return out
