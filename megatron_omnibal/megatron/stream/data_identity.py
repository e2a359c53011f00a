"""The identity of the balanced data stream, and where a run's stream starts.

Why: the balancer is deterministic, so a run's micro-batches follow from a handful of inputs
(the lengths, budgets, seed, DP size, micro-batches per step, balancer options). A resume finds
its place in the stream from Megatron's iteration counter alone, which is right only if those
inputs are the ones the checkpoint was trained with; with any other input the same counter points
into another stream and samples are silently trained twice or never. The identity is stored in
every checkpoint and compared on resume; a deliberate change starts a new stream whose origin
(the iteration, epoch and sample count it starts at) is stored from then on.

Pure Python and numpy: no torch, no Megatron.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from megatron_omnibal.balance.balancer import PACKER_VERSION
from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.data.lengths import LengthStats


def lengths_digest(lengths: LengthStats) -> str:
    """sha256 of the per-sample lengths in order (vit_num, token_num, image_flags, dataset):
    the same for the same records whatever the file format, different for any changed record.
    Arrays already of the hashed type are read in place (no copy of 12 million samples)."""
    h = hashlib.sha256()
    for array in (lengths.vit, lengths.tokens, lengths.image_flags):
        h.update(np.ascontiguousarray(array, "<i8"))
    h.update(np.ascontiguousarray(lengths.dataset, "<i4"))
    h.update("\0".join(lengths.names).encode())
    return h.hexdigest()


def _text(value: Any) -> str:
    """A balancer option as comparable, readable text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, kw_only=True)
class StreamIdentity:
    """Everything the balanced stream depends on. Two runs with equal identities read the same
    micro-batches at the same iteration (on every DP rank)."""

    lengths_sha256: str  # of the lengths the balancer sees (after tokens-per-tile, text scale)
    num_samples: int
    text_scale: int
    source: str  # "synthetic" or "dataset": the samples built for each length record
    vit_budget: int
    token_budget: int
    seed: int
    dp_size: int
    micro_batches: int
    mode: str
    algorithm: str
    oversize: str
    cost: str  # the modeled pack time (PackCost) or "null": tokens
    tail_tolerance: float
    isf_rounds: int
    isf_threshold: int  # 0: the algorithm's default
    levels: str  # packing levels (HBP), "[]" without
    curriculum_steps: int
    packer_version: int  # balance.balancer.PACKER_VERSION: the same inputs, other packs

    def __post_init__(self) -> None:
        for name in ("num_samples", "text_scale", "vit_budget", "token_budget", "dp_size",
                     "micro_batches", "isf_rounds", "isf_threshold",
                     "curriculum_steps", "packer_version"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"StreamIdentity.{name} must be an integer >= 0, got {value!r}")

    @classmethod
    def of(
        cls,
        lengths: LengthStats,
        *,
        text_scale: int,
        data: str,
        balance: BalanceConfig,
        lengths_sha256: str | None = None,
    ) -> StreamIdentity:
        """The identity of a run that balances `lengths` (as the model sees them) with
        `balance`; `lengths_sha256`: their lengths_digest where already taken (None: taken
        here)."""
        return cls(
            lengths_sha256=lengths_sha256 or lengths_digest(lengths),
            num_samples=len(lengths),
            text_scale=int(text_scale),
            source="synthetic" if data == "synthetic" else "dataset",
            vit_budget=balance.vit_budget,
            token_budget=balance.token_budget,
            seed=balance.seed,
            dp_size=balance.dp_size,
            micro_batches=balance.micro_batches,
            mode=balance.mode,
            algorithm=balance.algorithm,
            oversize=balance.oversize,
            cost=_text(None if balance.cost is None else balance.cost.to_dict()),
            tail_tolerance=float(balance.tail_tolerance),
            isf_rounds=balance.isf_rounds,
            isf_threshold=balance.isf_threshold or 0,
            levels=_text([lv.to_dict() for lv in balance.levels]),
            curriculum_steps=balance.curriculum_steps,
            packer_version=PACKER_VERSION,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StreamIdentity:
        """From a checkpoint; fields this version does not know are ignored, missing ones are
        an error (the checkpoint was made by another version)."""
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in d]
        if missing:
            raise ValueError(f"data-stream identity lacks {', '.join(missing)}")
        return cls(**{n: d[n] for n in names})

    def differences(self, other: StreamIdentity) -> list[tuple[str, Any, Any]]:
        """(field, this value, other value) for every field that differs."""
        return [
            (f.name, getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


@dataclass(frozen=True, kw_only=True)
class StreamOrigin:
    """Where the run's stream starts: at Megatron iteration `iteration`, the stream's step 0 is
    the first step of balancer epoch `epoch`, and `consumed_samples` samples were trained before.
    A run that never changed its data has the origin (0, 0, 0)."""

    iteration: int = 0
    epoch: int = 0
    consumed_samples: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"StreamOrigin.{f.name} must be an integer >= 0, got {value!r}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StreamOrigin:
        return cls(**{f.name: int(d[f.name]) for f in fields(cls)})


def restarted_origin(iteration: int, consumed_samples: int, num_samples: int) -> StreamOrigin:
    """The origin of a new stream started at a resume (--omnibal-allow-data-change): the next
    iteration reads the first step of a fresh epoch plan, numbered by the passes over the data
    already made (rounded up, so no epoch seed of the old stream's partial epoch is reused)."""
    if num_samples <= 0:
        raise ValueError(f"restarted_origin: num_samples must be > 0, got {num_samples}")
    epoch = math.ceil(consumed_samples / num_samples)
    return StreamOrigin(iteration=iteration, epoch=epoch, consumed_samples=consumed_samples)
