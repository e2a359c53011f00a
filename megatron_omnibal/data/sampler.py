"""BalancedBatchSampler: this DP rank's balanced micro-batches, epoch after epoch, resumable.

Every rank computes the epoch's plan itself (the balancer is deterministic for its seed), so no
communication is needed; epoch e uses seed + e, so each epoch is reshuffled and repacked.
The position (epoch, step, micro) is plain ints, so a checkpoint can store it as JSON.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from megatron_omnibal.data.isf import CostModel, balance
from megatron_omnibal.data.lengths import LengthStats
from megatron_omnibal.data.plan_io import BalancePlan, load_plan, save_plan

__all__ = ["BalancePlan", "BalancedBatchSampler", "balance", "load_plan", "save_plan"]


class BalancedBatchSampler:
    """Yields lists of sample indices: step 0 micro 0..M-1, step 1, ..., then the next epoch."""

    def __init__(self, lengths: LengthStats, *, dp_size: int, dp_rank: int, micro_batches: int,
                 vit_budget: int, token_budget: int, seed: int = 0, mode: str = "random",
                 algorithm: str = "default", oversize: str = "error",
                 cost: CostModel | None = None) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"BalancedBatchSampler: dp_rank {dp_rank} not in [0, {dp_size})")
        self.lengths = lengths
        self.dp_size, self.dp_rank, self.micro_batches = dp_size, dp_rank, micro_batches
        self._kwargs = dict(dp_size=dp_size, micro_batches=micro_batches, vit_budget=vit_budget,
                            token_budget=token_budget, mode=mode, algorithm=algorithm,
                            oversize=oversize, cost=cost)
        self.seed = seed
        self.epoch, self.step, self.micro = 0, 0, 0
        self._plan_epoch: int | None = None
        self._mine: list[np.ndarray] = []
        self._steps = 0
        self._load(0)  # validates the arguments now, not at the first batch

    def plan(self, epoch: int) -> BalancePlan:
        """The whole plan (all ranks) of one epoch."""
        return balance(self.lengths, seed=self.seed + epoch, **self._kwargs)

    def _load(self, epoch: int) -> None:
        if self._plan_epoch == epoch:
            return
        plan = self.plan(epoch)
        mine = np.flatnonzero(plan.pack_rank == self.dp_rank)  # plan is in (step, rank, micro)
        self._mine = [plan.pack(int(p)) for p in mine]
        self._steps = plan.num_steps
        self._plan_epoch = epoch

    @property
    def steps_per_epoch(self) -> int:
        """Global steps in the current epoch."""
        self._load(self.epoch)
        return self._steps

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first step."""
        if epoch < 0:
            raise ValueError(f"BalancedBatchSampler: epoch must be >= 0, got {epoch}")
        self.epoch, self.step, self.micro = int(epoch), 0, 0

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            self._load(self.epoch)
            index = self.step * self.micro_batches + self.micro
            if index >= len(self._mine):
                self.epoch, self.step, self.micro = self.epoch + 1, 0, 0
                continue
            batch = self._mine[index].tolist()
            # Advance before yielding: state_dict() names the next micro-batch to train (the
            # next epoch's first once this one is done).
            self.micro += 1
            if self.micro == self.micro_batches:
                self.step, self.micro = self.step + 1, 0
            if self.step == self._steps:
                self.epoch, self.step = self.epoch + 1, 0
            yield batch

    def state_dict(self) -> dict:
        """Where the next micro-batch comes from, as plain ints (JSON-able)."""
        return {"epoch": self.epoch, "step": self.step, "micro": self.micro, "seed": self.seed,
                "dp_size": self.dp_size, "micro_batches": self.micro_batches}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` was taken; refuses a state from another layout."""
        for key in ("dp_size", "micro_batches", "seed"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(f"BalancedBatchSampler: state has {key}={state[key]}, "
                                 f"this sampler {getattr(self, key)}")
        micro = int(state["micro"])
        if not 0 <= micro < self.micro_batches or int(state["step"]) < 0:
            raise ValueError(f"BalancedBatchSampler: bad position in state {state}")
        self.epoch, self.step, self.micro = int(state["epoch"]), int(state["step"]), micro
