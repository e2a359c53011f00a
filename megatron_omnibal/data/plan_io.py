"""The balance plan (DESIGN.md "Balance plan"): the dataclass and its `.npz` file.

A plan is what every data-parallel rank needs to train one epoch: which samples form each pack
and where each pack runs (global step, DP rank, micro-batch). It is saved so that a run can be
inspected, compared and replayed without recomputing it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PLAN_VERSION = 1
_ARRAYS = ("samples", "pack_ptr", "pack_step", "pack_rank", "pack_micro", "skipped")


@dataclass
class BalancePlan:
    """Packs of sample indices laid out over (step, dp rank, micro-batch).

    Pack p is `samples[pack_ptr[p]:pack_ptr[p+1]]`; packs are stored in (step, rank, micro)
    order. `skipped` lists samples not trained (only under `oversize="skip"`).
    """

    samples: np.ndarray
    pack_ptr: np.ndarray
    pack_step: np.ndarray
    pack_rank: np.ndarray
    pack_micro: np.ndarray
    skipped: np.ndarray
    meta: dict = field(default_factory=dict)

    @property
    def num_packs(self) -> int:
        return len(self.pack_ptr) - 1

    @property
    def num_steps(self) -> int:
        return int(self.pack_step.max()) + 1 if self.num_packs else 0

    def pack(self, p: int) -> np.ndarray:
        """Sample indices of pack p."""
        return self.samples[self.pack_ptr[p]:self.pack_ptr[p + 1]]

    def check(self, num_samples: int) -> None:
        """Raise ValueError unless every sample 0..num_samples-1 appears exactly once in
        `samples` or `skipped` and the layout is a full grid of (step, rank, micro)."""
        everything = np.concatenate([self.samples, self.skipped])
        counts = np.bincount(everything, minlength=num_samples) if len(everything) else \
            np.zeros(num_samples, np.int64)
        if len(counts) > num_samples:
            raise ValueError(f"plan: sample index {int(everything.max())} out of range "
                             f"({num_samples} samples)")
        if (counts != 1).any():
            bad = int(np.flatnonzero(counts != 1)[0])
            raise ValueError(f"plan: sample {bad} appears {int(counts[bad])} times "
                             "(expected exactly once in samples or skipped)")
        if self.pack_ptr[0] != 0 or self.pack_ptr[-1] != len(self.samples) or \
                (np.diff(self.pack_ptr) < 0).any():
            raise ValueError("plan: pack_ptr is not a non-decreasing cover of samples")
        dp, micro = int(self.meta.get("dp", 1)), int(self.meta.get("micro_batches", 1))
        slots = (self.pack_step * dp + self.pack_rank) * micro + self.pack_micro
        if len(np.unique(slots)) != self.num_packs or \
                self.num_packs != self.num_steps * dp * micro:
            raise ValueError("plan: (step, rank, micro) slots are not a full grid")


def save_plan(plan: BalancePlan, path: str | os.PathLike) -> None:
    """Write the plan as `.npz` (DESIGN.md "Balance plan")."""
    arrays = {name: np.asarray(getattr(plan, name), dtype=np.int64) for name in _ARRAYS}
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
            meta = json.loads(str(z["meta"]))
    except OSError as exc:
        raise ValueError(f"{path}: cannot read balance plan ({exc})") from exc
    return BalancePlan(meta=meta, **arrays)
