"""The balance plan: the dataclass, its invariants and its `.npz` file.

A plan is what every data-parallel rank needs to train one epoch: which samples form each pack,
where each pack runs (global step, DP rank, micro-batch) and from which packing level it comes.
It is saved so that a run can be inspected, compared and replayed without recomputing it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PLAN_VERSION = 2  # 2: pack_level and the levels in meta (version 1 files load as one level)
_ARRAYS = ("samples", "pack_ptr", "pack_step", "pack_rank", "pack_micro", "skipped")


def ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Concatenation of range(starts[k], starts[k] + sizes[k]) over k."""
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    out = np.arange(total, dtype=np.int64)
    out += np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
    return out


@dataclass
class BalancePlan:
    """Packs of sample indices laid out over (step, dp rank, micro-batch).

    Pack p is `samples[pack_ptr[p]:pack_ptr[p+1]]`; packs are stored in (step, rank, micro)
    order; `pack_level` is each pack's packing level (all packs of a step share one).
    `skipped` lists samples not trained (only under `oversize="skip"`). `meta` holds the
    BalanceConfig that made the plan (to_dict) and num_samples.
    """

    samples: np.ndarray
    pack_ptr: np.ndarray
    pack_step: np.ndarray
    pack_rank: np.ndarray
    pack_micro: np.ndarray
    skipped: np.ndarray
    meta: dict = field(default_factory=dict)
    pack_level: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.pack_level is None:
            self.pack_level = np.zeros(len(self.pack_ptr) - 1, np.int64)

    @property
    def num_packs(self) -> int:
        return len(self.pack_ptr) - 1

    @property
    def num_steps(self) -> int:
        return int(self.pack_step.max()) + 1 if self.num_packs else 0

    def pack(self, p: int) -> np.ndarray:
        """Sample indices of pack p."""
        return self.samples[self.pack_ptr[p]:self.pack_ptr[p + 1]]

    def packs_of(self, packs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(samples, pack_ptr) of the packs `packs` alone, in that order (one rank's share)."""
        sizes = np.diff(self.pack_ptr)[packs]
        ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        return self.samples[ranges(self.pack_ptr[packs], sizes)], ptr

    def level_micro_batches(self) -> list[int]:
        """Micro-batches per rank of a step, per level."""
        levels = self.meta.get("levels") or []
        if levels:
            return [int(lv["micro_batches"]) for lv in levels]
        return [int(self.meta.get("micro_batches", 1))]

    def step_levels(self) -> np.ndarray:
        """Level of each step."""
        out = np.zeros(self.num_steps, np.int64)
        out[self.pack_step] = self.pack_level
        return out

    def check(self, num_samples: int) -> None:
        """Raise ValueError unless every sample 0..num_samples-1 appears exactly once in
        `samples` or `skipped`, packs are in (step, rank, micro) order and each step is a full
        grid of dp ranks x its level's micro-batches, all of one level."""
        everything = np.concatenate([self.samples, self.skipped]).astype(np.int64, copy=False)
        if len(everything) and (everything.min() < 0 or everything.max() >= num_samples):
            bad = int(everything[(everything < 0) | (everything >= num_samples)][0])
            raise ValueError(f"plan: sample index {bad} out of range ({num_samples} samples)")
        counts = np.bincount(everything, minlength=num_samples)
        if (counts != 1).any():
            bad = int(np.flatnonzero(counts != 1)[0])
            raise ValueError(f"plan: sample {bad} appears {int(counts[bad])} times "
                             "(expected exactly once in samples or skipped)")
        if self.pack_ptr[0] != 0 or self.pack_ptr[-1] != len(self.samples) or \
                (np.diff(self.pack_ptr) < 0).any():
            raise ValueError("plan: pack_ptr is not a non-decreasing cover of samples")
        num = self.num_packs
        for name in ("pack_step", "pack_rank", "pack_micro", "pack_level"):
            if len(getattr(self, name)) != num:
                raise ValueError(f"plan: {name} has {len(getattr(self, name))} entries for "
                                 f"{num} packs")
        if num == 0:
            return
        dp = int(self.meta.get("dp_size", self.meta.get("dp", 1)))
        micro = self.level_micro_batches()
        if self.pack_level.min() < 0 or self.pack_level.max() >= len(micro):
            raise ValueError(f"plan: pack levels outside 0..{len(micro) - 1}")
        step_level = self.step_levels()
        if (step_level[self.pack_step] != self.pack_level).any():
            raise ValueError("plan: a step mixes packs of different levels")
        m = np.asarray(micro)[self.pack_level]
        if (self.pack_rank < 0).any() or (self.pack_rank >= dp).any() or \
                (self.pack_micro < 0).any() or (self.pack_micro >= m).any():
            raise ValueError("plan: pack rank or micro-batch outside its step's grid")
        per_step = np.bincount(self.pack_step, minlength=self.num_steps)
        if (per_step != dp * np.asarray(micro)[step_level]).any():
            s = int(np.flatnonzero(per_step != dp * np.asarray(micro)[step_level])[0])
            raise ValueError(f"plan: step {s} has {int(per_step[s])} packs, its grid "
                             f"{dp * micro[step_level[s]]}")
        key = (self.pack_step * dp + self.pack_rank) * int(max(micro)) + self.pack_micro
        if (np.diff(key) <= 0).any():
            raise ValueError("plan: packs are not in (step, rank, micro) order, or repeat a slot")


def save_plan(plan: BalancePlan, path: str | os.PathLike) -> None:
    """Write the plan as `.npz` (arrays int64, meta a 0-d JSON string)."""
    arrays = {name: np.asarray(getattr(plan, name), dtype=np.int64)
              for name in (*_ARRAYS, "pack_level")}
    meta = dict(plan.meta, version=PLAN_VERSION)
    np.savez_compressed(Path(path), meta=np.array(json.dumps(meta, sort_keys=True)), **arrays)


def load_plan(path: str | os.PathLike) -> BalancePlan:
    """Read a plan written by `save_plan`; errors name the file and the missing field."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in (*_ARRAYS, "meta") if k not in z.files]
            if missing:
                raise ValueError(f"{path}: not a balance plan (missing {', '.join(missing)})")
            arrays = {k: z[k].astype(np.int64) for k in _ARRAYS}
            level = z["pack_level"].astype(np.int64) if "pack_level" in z.files else None
            meta = json.loads(str(z["meta"]))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read balance plan ({exc})") from exc
    return BalancePlan(meta=meta, pack_level=level, **arrays)
