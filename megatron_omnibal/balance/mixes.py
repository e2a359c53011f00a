"""Generated long-tail vision-language length mixes, for tests and benchmarks.

Real SFT mixes are not uniform like the shipped InternVL subset: they combine text-only chats
(InternVL still passes one dummy tile through the vision encoder for those), single images at
dynamic resolution, multi-image samples and video-like samples of many one-tile frames, each
with a long tail of long conversations. Nothing here is real data: the shares and the log-normal
text lengths are chosen to look like such a mix, and every figure measured on it says so.
"""

from __future__ import annotations

import numpy as np

from megatron_omnibal.data.lengths import LengthStats, from_arrays

TOKENS_PER_TILE = 256
KINDS = ("text", "single-image", "multi-image", "video")
SHARES = (0.40, 0.35, 0.15, 0.10)
SINGLE_TILES = np.array([1, 3, 5, 7, 9, 13])  # InternVL dynamic tiling + thumbnail
SINGLE_P = np.array([0.15, 0.25, 0.30, 0.15, 0.10, 0.05])


def _text(rng: np.random.Generator, n: int, median: float, sigma: float, top: int
          ) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), 8, top).astype(np.int64)


def long_tail_mix(n: int, seed: int = 0, *, long_share: float = 0.02,
                  long_tokens: int = 16_384, max_frames: int = 32,
                  shares: tuple[float, float, float, float] = SHARES,
                  text_median: float = 350.0, text_sigma: float = 0.9) -> LengthStats:
    """`n` samples: 40% text-only (1 dummy tile), 35% one image (1-13 tiles), 15% 2-6 images
    (1-5 tiles each), 10% video-like (8-`max_frames` one-tile frames) by default (`shares`, in
    the order of KINDS); text lengths log-normal, the text-only ones of median `text_median`
    and sigma `text_sigma`, at most 6,000 tokens. `long_share` of the samples get a long text
    (up to `long_tokens` tokens in total), the tail that forces long packs. Datasets are the
    four kinds."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(len(KINDS), size=n, p=shares)
    vit = np.ones(n, np.int64)
    flags = np.zeros(n, np.int64)
    text = np.zeros(n, np.int64)
    for k in range(len(KINDS)):
        idx = np.flatnonzero(kind == k)
        m = len(idx)
        if k == 0:
            text[idx] = _text(rng, m, text_median, text_sigma, 6000)
        elif k == 1:
            vit[idx] = rng.choice(SINGLE_TILES, size=m, p=SINGLE_P)
            text[idx] = _text(rng, m, 120, 0.8, 3000)
        elif k == 2:
            images = rng.integers(2, 7, m)
            vit[idx] = [int(rng.integers(1, 6, c).sum()) for c in images]
            text[idx] = _text(rng, m, 250, 0.8, 3000)
        else:
            vit[idx] = rng.integers(8, max_frames + 1, m)
            text[idx] = _text(rng, m, 80, 0.6, 1000)
        if k:
            flags[idx] = vit[idx]
    tokens = flags * TOKENS_PER_TILE + text
    long = rng.random(n) < long_share
    room = np.maximum(long_tokens - tokens[long], 0)
    tokens[long] += (room * rng.uniform(0.3, 1.0, int(long.sum()))).astype(np.int64)
    return from_arrays(vit, tokens, image_flags=flags, dataset=kind, names=KINDS,
                       source=f"long_tail_mix(n={n}, seed={seed})")


# A heavy text-only tail: a quarter text-only samples of median 2,000 tokens (up to 6,000),
# beside single images, multi-image samples and videos (with max_frames=16: 8-16 tiles). Its
# packs cannot all match in both tokens and modeled time (a 5,000-token text's attention alone
# is above a pack's mean), the regime the random layout's light packs are for.
HEAVY_TEXT = {"shares": (0.25, 0.45, 0.20, 0.10), "text_median": 2000.0, "text_sigma": 0.7}
