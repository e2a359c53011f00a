"""The micro-batch every pipeline stage reads, and synthetic samples built from length statistics.

Why: all PP ranks read the same stream (the projector stage needs the token ids to place image
embeddings, the last stage needs the labels), so the format is shared by the data iterator, the
stage module and the loss. A micro-batch is one packed sequence (batch dimension 1) of several
samples with their boundaries (`cu_seqlens`), so attention can stay inside each sample, plus all
their image tiles. No real images ship with the project: `synthetic_sample` turns a length record
(tiles, tokens) into a deterministic random sample of exactly that shape, for tests, demo, bench.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

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
    """

    tokens: torch.Tensor  # int64 [L]
    labels: torch.Tensor  # int64 [L]
    images: torch.Tensor  # float32 [n, 3, H, W]
    image_flags: torch.Tensor  # int64 [n]


@dataclass
class MicroBatch:
    """A packed micro-batch: samples concatenated along the sequence, tiles along dim 0."""

    tokens: torch.Tensor  # int64 [1, S]
    labels: torch.Tensor  # int64 [1, S]; IGNORE_INDEX where loss_mask is 0
    loss_mask: torch.Tensor  # float32 [1, S]
    position_ids: torch.Tensor  # int64 [1, S]; restart at 0 in every sample
    cu_seqlens: torch.Tensor  # int32 [k + 1]; sample i is tokens[0, cu[i]:cu[i+1]]
    images: torch.Tensor  # float32 [n_tiles, 3, H, W]; n_tiles may be 0
    image_flags: torch.Tensor  # int64 [n_tiles]

    @property
    def num_samples(self) -> int:
        return len(self.cu_seqlens) - 1

    def to(self, device: torch.device | str | int) -> MicroBatch:
        """A copy with every tensor on `device` (the iterator yields CPU tensors)."""
        return MicroBatch(
            **{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)}
        )

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, torch.Tensor]) -> MicroBatch:
        return cls(**{f.name: d[f.name] for f in fields(cls)})


def collate(samples: Sequence[Sample]) -> MicroBatch:
    """Pack samples into one micro-batch (order kept; every sample appears exactly once)."""
    if not samples:
        raise ValueError("collate: no samples (a micro-batch needs at least one)")
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
    images = torch.cat([s.images.reshape(-1, *tile_shape) for s in samples])
    flags = torch.cat([s.image_flags for s in samples]).to(torch.int64)
    return MicroBatch(
        tokens=tokens,
        labels=labels,
        loss_mask=(labels != IGNORE_INDEX).float(),
        position_ids=position_ids,
        cu_seqlens=cu,
        images=images.float(),
        image_flags=flags,
    )


def synthetic_sample(index: int, lengths: LengthStats, spec: ModelSpec, seed: int = 0) -> Sample:
    """A deterministic random sample shaped like length record `index`.

    `vit` tiles of 3 x image_size x image_size pixels (the first `image_flags` real, the rest
    dummy tiles), `token_num` tokens of which tokens_per_tile per real tile are image
    placeholders right after a BOS token; the loss covers the second half of the text (the
    "answer"). Same (index, seed) -> same sample, on every rank and every run.
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
    text = rng.integers(1, vocab_size - 1, size=n_tok - n_img)
    text[text >= image_token_id] += 1  # never draw the placeholder id as text
    text[0] = 0  # BOS
    ids = np.concatenate([text[:1], np.full(n_img, image_token_id), text[1:]])
    targets = np.full(n_tok, IGNORE_INDEX, dtype=np.int64)
    n_text = n_tok - n_img
    answer_start = 1 + n_img + (n_text - 1) // 2
    targets[answer_start - 1 : n_tok - 1] = ids[answer_start:]
    pixels = rng.standard_normal((n_tiles, 3, image_size, image_size), dtype=np.float32)
    flags = np.zeros(n_tiles, dtype=np.int64)
    flags[:n_real] = 1
    return Sample(
        tokens=torch.from_numpy(ids.astype(np.int64)),
        labels=torch.from_numpy(targets),
        images=torch.from_numpy(pixels),
        image_flags=torch.from_numpy(flags),
    )
