"""The micro-batch every pipeline stage reads, and synthetic samples built from length statistics.

Why: all PP ranks read the same stream (the projector stage needs the token ids to place image
embeddings, the last stage needs the labels), so the format is shared by the data iterator, the
stage module and the loss. A micro-batch is one packed sequence (batch dimension 1) of several
samples with their boundaries (`cu_seqlens`), so attention can stay inside each sample, plus all
their image tiles. No real images ship with the project: `synthetic_sample` turns a length record
(tiles, tokens) into a deterministic random sample of exactly that shape, for tests, demo, bench.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megatron_omnibal.data.lengths import LengthStats

if TYPE_CHECKING:
    from megatron_omnibal.models.spec import ModelSpec

IGNORE_INDEX = -100


@dataclass
class Sample:
    """One training sample: token ids with image placeholders, shifted labels, image tiles.

    `labels[i]` is the target of position i (IGNORE_INDEX: no loss). `images` has one row per tile
    the ViT sees; `image_flags[j]` is 1 for a real tile, 0 for a dummy (text-only) tile whose
    embeddings are dropped. The sequence holds tokens_per_tile placeholders per real tile.

    A native-resolution tower (Qwen2.5-VL) reads whole images instead: `images` holds their
    patches [patches, 3 x frames x pixels] (block-major, as its image processor emits them),
    `image_grid` each image's (t, h, w) in patches, `image_flags` a 1 per image; the sequence
    holds t h w / merge^2 placeholders per image. A video is such an image of t temporal
    patches (two frames each) whose `grid_seconds` entry (the seconds a temporal patch spans;
    0 for a still image, None: all still) spaces its M-RoPE time positions.
    """

    tokens: torch.Tensor  # int64 [L]
    labels: torch.Tensor  # int64 [L]
    images: torch.Tensor  # float32 [n, 3, H, W] (tiles) or [patches, patch values] (native)
    image_flags: torch.Tensor  # int64 [n]
    image_grid: torch.Tensor | None = None  # int64 [images, 3]: native-resolution towers only
    grid_seconds: torch.Tensor | None = None  # float32 [images]: videos' seconds per t patch


@dataclass
class MicroBatch:
    """A packed micro-batch: samples concatenated along the sequence, tiles along dim 0.

    `level` is the packing level of its step (hierarchical balance packing): the stage modules
    recompute as that level says. It travels with the micro-batch because the loader draws
    ahead of the micro-batch being trained.
    """

    tokens: torch.Tensor  # int64 [1, S]
    labels: torch.Tensor  # int64 [1, S]; IGNORE_INDEX where loss_mask is 0
    loss_mask: torch.Tensor  # float32 [1, S]
    position_ids: torch.Tensor  # int64 [1, S]; restart at 0 in every sample
    cu_seqlens: torch.Tensor  # int32 [k + 1]; sample i is tokens[0, cu[i]:cu[i+1]]
    images: torch.Tensor  # float32 [n_tiles, 3, H, W]; n_tiles may be 0 (native: patches)
    image_flags: torch.Tensor  # int64 [n_tiles]
    level: int = 0
    image_grid: torch.Tensor | None = None  # int64 [images, 3]: native-resolution towers only
    grid_seconds: torch.Tensor | None = None  # float32 [images]: native, videos' t spacing

    @property
    def num_samples(self) -> int:
        return len(self.cu_seqlens) - 1

    def to(self, device: torch.device | str | int) -> MicroBatch:
        """A copy with every tensor on `device` (the iterator yields CPU tensors); shape-only
        images stay shape-only (nothing is copied for them)."""
        return self._map(lambda t: _move(t, device))

    def pin_memory(self) -> MicroBatch:
        """Pinned host copies for fast host-to-GPU copies (the DataLoader's pin thread calls
        it); shape-only images are left as they are."""
        return self._map(lambda t: t if is_shape_only(t) else t.pin_memory())

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> MicroBatch:
        return MicroBatch(**{k: fn(v) if isinstance(v, torch.Tensor) else v
                             for k, v in self.as_dict().items()})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MicroBatch:
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})


def validate_batch(
    spec: ModelSpec,
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    images: torch.Tensor,
    image_flags: torch.Tensor,
    cu_seqlens: torch.Tensor,
    image_grid: torch.Tensor | None = None,
    grid_seconds: torch.Tensor | None = None,
) -> None:
    """Raise ValueError unless the micro-batch fits the model (shapes, placeholders, bounds).

    Run on the CPU tensors the loader built (step.stage_inputs), never on the device: every
    check reads values back, which on a GPU would stall the pipeline once per micro-batch."""
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(f"micro-batch tokens have shape {tuple(tokens.shape)}, expected [1, S]")
    seq = tokens.shape[1]
    if labels is not None and labels.shape != tokens.shape:
        raise ValueError(f"micro-batch labels {tuple(labels.shape)} != tokens {(1, seq)}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != seq or any(b < a for a, b in zip(cu[:-1], cu[1:], strict=True)):
        raise ValueError(f"micro-batch cu_seqlens {cu} do not span 0..{seq}")
    if spec.vit.native_resolution:
        _validate_native(spec, tokens, images, image_flags, image_grid)
        if grid_seconds is not None and tuple(grid_seconds.shape) != (len(image_grid),):
            raise ValueError(f"micro-batch has {len(image_grid)} image grids but grid_seconds "
                             f"of shape {tuple(grid_seconds.shape)}")
        return
    size = spec.vit.image_size
    if images.dim() != 4 or tuple(images.shape[1:]) != (3, size, size):
        raise ValueError(
            f"micro-batch images have shape {tuple(images.shape)}, expected [n, 3, {size}, {size}]"
        )
    if image_flags.shape != (images.shape[0],):
        raise ValueError(
            f"micro-batch has {images.shape[0]} tiles but {image_flags.numel()} image_flags"
        )
    slots = int((tokens == spec.image_token_id).sum())
    real = int(image_flags.sum())
    if slots != real * spec.tokens_per_tile:
        raise ValueError(
            f"micro-batch has {slots} image placeholder tokens (id {spec.image_token_id}) but "
            f"{real} real tiles x {spec.tokens_per_tile} tokens per tile = "
            f"{real * spec.tokens_per_tile}"
        )


def _validate_native(
    spec: ModelSpec,
    tokens: torch.Tensor,
    images: torch.Tensor,
    image_flags: torch.Tensor,
    image_grid: torch.Tensor | None,
) -> None:
    """The native-resolution part of validate_batch: patches, grids and placeholders agree."""
    v = spec.vit
    if image_grid is None or image_grid.dim() != 2 or image_grid.shape[1] != 3:
        got = None if image_grid is None else tuple(image_grid.shape)
        raise ValueError(f"micro-batch image_grid has shape {got}, expected [images, 3]")
    grids = image_grid.tolist()
    merge = v.spatial_merge_size
    for i, (_, h, w) in enumerate(grids):
        if h % merge or w % merge:
            raise ValueError(f"micro-batch image {i} of {h}x{w} patches: not divisible by the "
                             f"merge size {merge}")  # fmt: skip
    patches = sum(t * h * w for t, h, w in grids)
    if images.dim() != 2 or tuple(images.shape) != (patches, v.patch_dim):
        raise ValueError(
            f"micro-batch images have shape {tuple(images.shape)}, expected [{patches}, "
            f"{v.patch_dim}] (the patches of its {len(grids)} image grids)"
        )
    if image_flags.shape != (len(grids),):
        raise ValueError(
            f"micro-batch has {len(grids)} image grids but {image_flags.numel()} image_flags"
        )
    slots = int((tokens == spec.image_token_id).sum())
    if slots * merge * merge != patches:
        raise ValueError(
            f"micro-batch has {slots} image placeholder tokens (id {spec.image_token_id}) but "
            f"its images have {patches} patches = {patches // (merge * merge)} merged tokens"
        )


def shape_only_images(tiles: int, size: int) -> torch.Tensor:
    """A float32 [tiles, 3, size, size] tensor that holds no pixels (one zero, broadcast).

    Pipeline ranks without the patch embedding never read pixels, but the micro-batch they
    check and pass on must still say how many tiles it has; this costs no memory and no copy.
    """
    return torch.zeros((), dtype=torch.float32).expand(tiles, 3, size, size)


def is_shape_only(t: torch.Tensor) -> bool:
    """Whether `t` is a shape-only (broadcast, pixel-free) image tensor (tiles or patches)."""
    return t.dim() in (2, 4) and t.numel() > 1 and all(s == 0 for s in t.stride())


def _move(t: torch.Tensor, device: torch.device | str | int) -> torch.Tensor:
    if is_shape_only(t):
        return torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)
    return t.to(device, non_blocking=True)


def drop_samples(batch: MicroBatch, drop: Sequence[int], tiles: Sequence[int]) -> MicroBatch | None:
    """The micro-batch without the samples at positions `drop` (`tiles`: tiles per sample).

    None when nothing is left. Used when a sample that failed to load is skipped on every
    pipeline rank: the packed tensors are cut at the samples' boundaries.
    """
    drop = set(drop)
    keep = [k for k in range(batch.num_samples) if k not in drop]
    if not keep:
        return None
    cu = batch.cu_seqlens.tolist()
    starts = [0, *torch.cumsum(torch.tensor(list(tiles), dtype=torch.int64), 0).tolist()]
    tok = torch.cat([torch.arange(cu[k], cu[k + 1]) for k in keep])
    img = torch.cat([torch.arange(starts[k], starts[k + 1]) for k in keep])
    lengths = torch.tensor([cu[k + 1] - cu[k] for k in keep], dtype=torch.int64)
    new_cu = torch.zeros(len(keep) + 1, dtype=torch.int32)
    new_cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    images = batch.images
    grid = seconds = None
    if batch.image_grid is not None:  # native: `tiles` counts patches; grids follow them
        bounds = [0, *batch.image_grid.prod(dim=1).cumsum(0).tolist()]
        first = [bounds.index(e) for e in starts]  # sample k: grids first[k]..first[k + 1]
        grid = torch.cat([batch.image_grid[first[k] : first[k + 1]] for k in keep])
        if batch.grid_seconds is not None:
            seconds = torch.cat([batch.grid_seconds[first[k] : first[k + 1]] for k in keep])
        flags = torch.ones(len(grid), dtype=torch.int64)
        images = images[img] if not is_shape_only(images) else (
            torch.zeros((), dtype=images.dtype).expand(len(img), images.shape[1]))  # fmt: skip
    elif is_shape_only(images):
        images = shape_only_images(len(img), images.shape[-1])
    else:
        images = images[img]
    return MicroBatch(
        tokens=batch.tokens[:, tok],
        labels=batch.labels[:, tok],
        loss_mask=batch.loss_mask[:, tok],
        position_ids=batch.position_ids[:, tok],
        cu_seqlens=new_cu,
        images=images,
        image_flags=flags if grid is not None else batch.image_flags[img],
        level=batch.level,
        image_grid=grid,
        grid_seconds=seconds,
    )


def _output(tiles: int, tile_shape: tuple[int, ...]) -> torch.Tensor:
    """The batch's pixel tensor; inside a DataLoader worker it is allocated in shared memory,
    so handing it to the training process copies nothing (as torch's default_collate does)."""
    from torch.utils.data import get_worker_info

    if get_worker_info() is None:
        return torch.empty((tiles, *tile_shape), dtype=torch.float32)
    numel = tiles * math.prod(tile_shape)
    storage = torch.UntypedStorage._new_shared(numel * 4)
    return torch.empty(0, dtype=torch.float32).set_(storage).view(tiles, *tile_shape)


def collate(samples: Sequence[Sample]) -> MicroBatch:
    """Pack samples into one micro-batch (order kept; every sample appears exactly once)."""
    if not samples:
        raise ValueError("collate: no samples (a micro-batch needs at least one)")
    if any(s.image_grid is not None for s in samples):
        return _collate_native(samples)
    for i, s in enumerate(samples):
        if s.tokens.shape != s.labels.shape or s.tokens.dim() != 1 or len(s.tokens) == 0:
            raise ValueError(
                f"collate: sample {i} has tokens {tuple(s.tokens.shape)} and labels "
                f"{tuple(s.labels.shape)}; both must be the same non-empty 1-D length"
            )
        if s.images.dim() != 4 or s.images.shape[0] != len(s.image_flags):
            raise ValueError(
                f"collate: sample {i} has images {tuple(s.images.shape)} and "
                f"{len(s.image_flags)} image_flags; expected [n, 3, H, W] and n flags"
            )
    lengths = torch.tensor([len(s.tokens) for s in samples], dtype=torch.int64)
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    tokens = torch.cat([s.tokens for s in samples])[None]
    labels = torch.cat([s.labels for s in samples])[None]
    position_ids = torch.cat([torch.arange(int(n)) for n in lengths])[None]
    shapes = {tuple(s.images.shape[1:]) for s in samples if len(s.images)}
    if len(shapes) > 1:
        raise ValueError(f"collate: image tiles of different shapes {sorted(shapes)}")
    tile_shape = shapes.pop() if shapes else tuple(samples[0].images.shape[1:])
    n_tiles = sum(len(s.images) for s in samples)
    if all(is_shape_only(s.images) or not len(s.images) for s in samples):
        images = shape_only_images(n_tiles, tile_shape[-1])
    elif any(is_shape_only(s.images) for s in samples):
        raise ValueError("collate: samples with pixels and shape-only samples mixed")
    else:
        images = torch.cat([s.images.reshape(-1, *tile_shape) for s in samples],
                           out=_output(n_tiles, tile_shape))
    flags = torch.cat([s.image_flags for s in samples]).to(torch.int64)
    return MicroBatch(
        tokens=tokens,
        labels=labels,
        loss_mask=(labels != IGNORE_INDEX).float(),
        position_ids=position_ids,
        cu_seqlens=cu,
        images=images if images.dtype == torch.float32 else images.float(),
        image_flags=flags,
    )


def _collate_native(samples: Sequence[Sample]) -> MicroBatch:
    """collate for native-resolution samples: patches and image grids concatenated."""
    for i, s in enumerate(samples):
        if s.image_grid is None or s.tokens.shape != s.labels.shape or s.tokens.dim() != 1:
            raise ValueError(
                f"collate: sample {i} has tokens {tuple(s.tokens.shape)}, labels "
                f"{tuple(s.labels.shape)} and image_grid {s.image_grid!r}: native-resolution "
                "samples need equal 1-D tokens and labels and an image grid each"
            )
    lengths = torch.tensor([len(s.tokens) for s in samples], dtype=torch.int64)
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0).to(torch.int32)
    labels = torch.cat([s.labels for s in samples])[None]
    if all(is_shape_only(s.images) or not len(s.images) for s in samples):
        patches = sum(len(s.images) for s in samples)
        images = torch.zeros((), dtype=torch.float32).expand(patches, samples[0].images.shape[1])
    else:
        images = torch.cat([s.images for s in samples]).float()
    return MicroBatch(
        tokens=torch.cat([s.tokens for s in samples])[None],
        labels=labels,
        loss_mask=(labels != IGNORE_INDEX).float(),
        position_ids=torch.cat([torch.arange(int(n)) for n in lengths])[None],
        cu_seqlens=cu,
        images=images,
        image_flags=torch.cat([s.image_flags for s in samples]).to(torch.int64),
        image_grid=torch.cat([s.image_grid.reshape(-1, 3) for s in samples]).to(torch.int64),
        grid_seconds=torch.cat([
            s.grid_seconds.reshape(-1) if s.grid_seconds is not None
            else torch.zeros(s.image_grid.reshape(-1, 3).shape[0]) for s in samples
        ]).to(torch.float32),
    )


@dataclass(frozen=True)
class SyntheticSamples:
    """`make_sample(i, epoch)`: synthetic samples shaped like the length records of each
    epoch (`lengths_of(epoch)`: video samples change with the epoch)."""

    lengths_of: Callable[[int], LengthStats]
    spec: ModelSpec
    seed: int = 0
    pixels: bool = True

    def __call__(self, index: int, epoch: int) -> Sample:
        return synthetic_sample(index, self.lengths_of(epoch), self.spec, self.seed, self.pixels)


def synthetic_sample(
    index: int, lengths: LengthStats, spec: ModelSpec, seed: int = 0, pixels: bool = True
) -> Sample:
    """A deterministic random sample shaped like length record `index`.

    `vit` tiles of 3 x image_size x image_size pixels (the first `image_flags` real, the rest
    dummy tiles), `token_num` tokens of which tokens_per_tile per real tile are image
    placeholders right after a BOS token; the loss covers the second half of the text (the
    "answer"). Same (index, seed) -> same sample, on every rank and every run. Without
    `pixels` the tiles are shape-only (ranks that do not embed patches). A native-resolution
    model's tile is one merged patch group: the sample holds one image of the `image_flags`
    real units (a grid as square as they allow), its placeholders after the BOS token.
    """
    image_size, tokens_per_tile = spec.vit.image_size, spec.tokens_per_tile
    vocab_size, image_token_id = spec.llm.vocab_size, spec.image_token_id
    if not 0 <= index < len(lengths):
        raise IndexError(f"synthetic_sample: index {index} outside 0..{len(lengths) - 1}")
    n_tiles = int(lengths.vit[index])
    n_real = int(lengths.image_flags[index])
    n_tok = int(lengths.tokens[index])
    n_img = n_real * tokens_per_tile
    if n_real > n_tiles:
        raise ValueError(
            f"synthetic_sample: record {index} has image_flags={n_real} > vit_num={n_tiles}"
        )
    if n_tok < n_img + 2:
        raise ValueError(
            f"synthetic_sample: record {index} has token_num={n_tok}, fewer than its "
            f"{n_real} real tiles x {tokens_per_tile} image tokens + 2 text tokens"
        )
    if not 1 <= image_token_id < vocab_size:
        raise ValueError(f"synthetic_sample: image_token_id {image_token_id} outside the vocab")
    rng = np.random.default_rng([seed, index])
    if spec.vit.native_resolution:
        return _native_synthetic(rng, n_real, n_tok, spec, pixels)
    ids, targets = _text_and_targets(rng, n_tok, n_img, spec)
    if pixels:
        images = torch.from_numpy(
            rng.standard_normal((n_tiles, 3, image_size, image_size), dtype=np.float32)
        )
    else:
        images = shape_only_images(n_tiles, image_size)
    flags = np.zeros(n_tiles, dtype=np.int64)
    flags[:n_real] = 1
    return Sample(
        tokens=torch.from_numpy(ids.astype(np.int64)),
        labels=torch.from_numpy(targets),
        images=images,
        image_flags=torch.from_numpy(flags),
    )


def _text_and_targets(
    rng: np.random.Generator, n_tok: int, n_img: int, spec: ModelSpec
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (BOS, n_img placeholders, random text) and their targets (the second half of
    the text)."""
    vocab_size, image_token_id = spec.llm.vocab_size, spec.image_token_id
    text = rng.integers(1, vocab_size - 1, size=n_tok - n_img)
    text[text >= image_token_id] += 1  # never draw the placeholder id as text
    text[0] = 0  # BOS
    ids = np.concatenate([text[:1], np.full(n_img, image_token_id), text[1:]])
    targets = np.full(n_tok, IGNORE_INDEX, dtype=np.int64)
    answer_start = 1 + n_img + (n_tok - n_img - 1) // 2
    targets[answer_start - 1 : n_tok - 1] = ids[answer_start:]
    return ids, targets


def _native_synthetic(
    rng: np.random.Generator, units: int, n_tok: int, spec: ModelSpec, pixels: bool
) -> Sample:
    merge = spec.vit.spatial_merge_size
    rows = max((d for d in range(1, int(units**0.5) + 1) if units % d == 0), default=0)
    grid = [[1, rows * merge, units // rows * merge]] if units else []
    ids, targets = _text_and_targets(rng, n_tok, units, spec)
    shape = (units * merge * merge, spec.vit.patch_dim)
    if pixels:
        images = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))
    else:
        images = torch.zeros((), dtype=torch.float32).expand(shape)
    return Sample(
        tokens=torch.from_numpy(ids.astype(np.int64)),
        labels=torch.from_numpy(targets),
        images=images,
        image_flags=torch.ones(len(grid), dtype=torch.int64),
        image_grid=torch.tensor(grid, dtype=torch.int64).reshape(-1, 3),
    )
