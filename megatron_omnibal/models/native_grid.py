"""Positions and attention windows of a native-resolution VLM (Qwen2.5-VL), as pure numpy.

Why pure functions: every pipeline stage derives them from the micro-batch it reads (image grids,
token ids, sample boundaries) instead of receiving them from the stage before, and they are
checked against transformers' own code in the tests.

An image or video of grid (t, h, w) patches (t temporal patches, each two frames; h, w divisible
by the merge size m) is laid out block-major: each m x m group of neighbouring patches is
contiguous, groups row by row, temporal patch after temporal patch. The merged group is the
unit of the windows and of the LLM tokens; full attention and the windows stay within one
temporal patch of one image or video, as transformers' cu_seqlens per grid t.
"""

from __future__ import annotations

import numpy as np


def _grids(grids: np.ndarray) -> np.ndarray:
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    if (grids <= 0).any():
        raise ValueError(f"image grids must be positive (t, h, w) triples, got {grids.tolist()}")
    return grids


def patch_rows_cols(grids: np.ndarray, merge: int) -> np.ndarray:
    """[patches, 2] (row, column) of every patch in the block-major order: the 2-D rotary
    positions of the vision tower (repeated for every temporal patch)."""
    out = []
    for t, h, w in _grids(grids).tolist():
        if h % merge or w % merge:
            raise ValueError(f"image grid {h}x{w} is not divisible by the merge size {merge}")
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=1), (t, 1)))
    return np.concatenate(out) if out else np.zeros((0, 2), dtype=np.int64)


def frame_seqlens(grids: np.ndarray) -> np.ndarray:
    """Cumulative patch counts [k + 1] of the full-attention segments: one per temporal patch
    of each image (attention never crosses images or frame pairs)."""
    g = _grids(grids)
    lengths = np.repeat(g[:, 1] * g[:, 2], g[:, 0])
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def window_index(grids: np.ndarray, merge: int, window_units: int) -> tuple[np.ndarray, np.ndarray]:
    """(order [merged units], cumulative patch counts of the windows [k + 1]).

    `order` lists the merged units window by window (windows of window_units x window_units
    units laid per image and frame, row by row, the right and bottom ones cut short): the
    vision tower runs on its units in this order and the merger's output is put back with its
    inverse permutation. Windowed layers attend within each window.
    """
    unit = merge * merge
    order, bounds, offset = [], [0], 0
    for t, h, w in _grids(grids).tolist():
        gh, gw = h // merge, w // merge
        index = np.arange(t * gh * gw).reshape(t, gh, gw)
        nh, nw = -(-gh // window_units), -(-gw // window_units)
        padded = np.full((t, nh * window_units, nw * window_units), -1, dtype=np.int64)
        padded[:, :gh, :gw] = index
        windows = padded.reshape(t, nh, window_units, nw, window_units).transpose(0, 1, 3, 2, 4)
        windows = windows.reshape(t * nh * nw, window_units * window_units)
        for win in windows:
            kept = win[win >= 0]
            if len(kept):
                order.append(kept + offset)
                bounds.append(bounds[-1] + len(kept) * unit)
        offset += t * gh * gw
    order_arr = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    return order_arr, np.asarray(bounds, dtype=np.int64)


def mrope_position_ids(
    tokens: np.ndarray,
    cu_seqlens: np.ndarray,
    grids: np.ndarray,
    image_token_id: int,
    merge: int,
    grid_seconds: np.ndarray | None = None,
    tokens_per_second: float = 2.0,
) -> np.ndarray:
    """[3, S] (time, height, width) M-RoPE positions of a packed sequence, restarting in every
    sample (cu_seqlens bounds them), as transformers 5's `get_rope_index` computes them.

    Text advances all three axes by one per token. Grid i (in sequence order) occupies
    t h w / merge^2 placeholder tokens starting at position p: height p + row, width p + column
    of its merged grid, time p for an image; a video (`grid_seconds[i]` > 0, the seconds one
    temporal patch spans) takes time p + int(k x tokens_per_second x seconds) for its k-th
    temporal patch (in float32, as transformers multiplies). The text after a grid resumes at
    p + max(h, w) / merge, whatever its temporal span. Consecutive placeholders are split
    between grids by their sizes.
    """
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    cu = np.asarray(cu_seqlens, dtype=np.int64).reshape(-1)
    g = _grids(grids) if len(np.asarray(grids)) else np.zeros((0, 3), dtype=np.int64)
    seconds = (np.zeros(len(g), np.float32) if grid_seconds is None
               else np.asarray(grid_seconds, np.float32).reshape(-1))  # fmt: skip
    if len(seconds) != len(g):
        raise ValueError(f"{len(g)} image grids but {len(seconds)} grid_seconds")
    out = np.zeros((3, len(tokens)), dtype=np.int64)
    image = 0
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        pos, i = 0, start
        while i < end:
            if tokens[i] != image_token_id:
                out[:, i] = pos
                pos, i = pos + 1, i + 1
                continue
            if image >= len(g):
                raise ValueError(
                    f"image placeholder at token {i} has no image grid left ({len(g)} given)"
                )
            t, h, w = g[image].tolist()
            if t != 1 and seconds[image] <= 0:
                raise ValueError(f"image {image} has {t} temporal patches but no seconds per "
                                 "temporal patch (a video needs its grid_seconds)")  # fmt: skip
            gh, gw = h // merge, w // merge
            n = t * gh * gw
            if i + n > end or (tokens[i : i + n] != image_token_id).any():
                raise ValueError(
                    f"image {image} of grid {t}x{h}x{w} needs {n} placeholder tokens from "
                    f"token {i} inside its sample [{start}, {end})"
                )
            step = np.float32(tokens_per_second) * seconds[image]
            times = (np.arange(t, dtype=np.float32) * step).astype(np.int64)
            tt, hh, ww = np.meshgrid(times, np.arange(gh), np.arange(gw), indexing="ij")
            out[0, i : i + n] = pos + tt.reshape(-1)
            out[1, i : i + n] = pos + hh.reshape(-1)
            out[2, i : i + n] = pos + ww.reshape(-1)
            pos += max(gh, gw)
            i += n
            image += 1
    if image != len(g):
        raise ValueError(f"{len(g)} image grids but placeholders for {image} images")
    return out
