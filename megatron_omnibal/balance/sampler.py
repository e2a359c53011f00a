"""BalancedBatchSampler: this DP rank's balanced micro-batches, epoch after epoch, resumable.

Every rank computes the epoch's plan itself (the balancer is deterministic for its config), so
no communication is needed; epoch e uses seed + e, so each epoch is reshuffled and repacked.
Samples whose lengths change from epoch to epoch (videos trained on a drawn number of frames)
are balanced with their lengths of that epoch: `lengths_of_epoch(e)`, a pure function of the
epoch that every rank computes alike; `last_epoch` is the epoch of the micro-batch yielded last.
The position (epoch, step, micro) is plain ints, so a checkpoint can store it as JSON.

With packing levels (hierarchical balance packing) each step comes from one level, whose
micro-batch count and per-stage recompute the training loop must use for that step:
`level_of_step(step)` / `micro_batches_of_step(step)` tell it ahead of the step (the current
epoch), `last_level` is the level of the micro-batch yielded last, and `levels` holds each
level's budgets and recompute counts.

The last epoch plan computed is kept per process (`shared_plan`): the samplers of one process
(the training log's, the data iterator's) ask for the same epoch at start-up, and balance it
once between them. A training run passes `plan_of_epoch` instead, which balances once per node
(megatron/stream/node_plans.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from megatron_omnibal.balance.balancer import balance
from megatron_omnibal.balance.config import BalanceConfig, Level
from megatron_omnibal.balance.plan_io import BalancePlan
from megatron_omnibal.data.lengths import LengthStats

_recent: list[tuple[LengthStats, BalanceConfig, BalancePlan]] = []  # the last plan computed


def shared_plan(lengths: LengthStats, config: BalanceConfig) -> BalancePlan:
    """balance(lengths, config), computed once per process for the same lengths object and
    config while it is the last one asked for; its arrays are read-only (it is shared)."""
    for held, held_config, plan in _recent:
        if held is lengths and held_config == config:
            return plan
    plan = balance(lengths, config)
    for name in ("samples", "pack_ptr", "pack_step", "pack_rank", "pack_micro", "skipped",
                 "pack_level"):
        getattr(plan, name).setflags(write=False)
    _recent[:] = [(lengths, config, plan)]
    return plan


class BalancedBatchSampler:
    """Yields lists of sample indices: step 0 micro 0..M-1, step 1, ..., then the next epoch."""

    def __init__(self, lengths: LengthStats, config: BalanceConfig, *, dp_rank: int,
                 lengths_of_epoch: Callable[[int], LengthStats] | None = None,
                 plan_of_epoch: Callable[[int], BalancePlan] | None = None) -> None:
        if not 0 <= dp_rank < config.dp_size:
            raise ValueError(f"BalancedBatchSampler: dp_rank {dp_rank} not in "
                             f"[0, {config.dp_size})")
        self.lengths = lengths
        self._lengths_of_epoch = lengths_of_epoch
        self._plan_of_epoch = plan_of_epoch
        self.config = config
        self.dp_rank = dp_rank
        self.epoch, self.step, self.micro = 0, 0, 0
        self.last_level = 0
        self.last_epoch = 0
        self._plan_epoch: int | None = None
        self._samples = np.zeros(0, np.int64)  # this rank's packs: samples, pack pointer
        self._ptr = np.zeros(1, np.int64)
        self._first: np.ndarray = np.zeros(1, np.int64)  # this rank's pack of each step's first
        self._step_level: np.ndarray = np.zeros(0, np.int64)
        self._load(0)  # validates now, not at the first batch

    @property
    def dp_size(self) -> int:
        return self.config.dp_size

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def levels(self) -> tuple[Level, ...]:
        """Budgets, micro-batches and per-stage recompute of each level (one without levels)."""
        return self.config.all_levels

    def lengths_of(self, epoch: int) -> LengthStats:
        """The samples' lengths in `epoch` (the same in every epoch without videos)."""
        return self.lengths if self._lengths_of_epoch is None else self._lengths_of_epoch(epoch)

    def plan(self, epoch: int) -> BalancePlan:
        """The whole plan (all ranks) of one epoch: `plan_of_epoch`'s where given (the plan of
        balance() for the epoch's lengths and seed, made elsewhere: computed once per node),
        else computed in this process."""
        if self._plan_of_epoch is not None:
            return self._plan_of_epoch(epoch)
        return shared_plan(self.lengths_of(epoch), self.config.with_seed(self.config.seed + epoch))

    def _load(self, epoch: int) -> None:
        if self._plan_epoch == epoch:
            return
        plan = self.plan(epoch)
        # This rank's packs in (step, micro) order as two arrays, not an object per pack: the
        # whole plan is dropped once its share is taken.
        mine = np.flatnonzero(plan.pack_rank == self.dp_rank)  # plan is in (step, rank, micro)
        self._samples, self._ptr = plan.packs_of(mine)
        self._step_level = plan.step_levels()
        micro = np.asarray(plan.level_micro_batches())[self._step_level]
        self._first = np.concatenate([[0], np.cumsum(micro)]).astype(np.int64)
        self._plan_epoch = epoch

    @property
    def steps_per_epoch(self) -> int:
        """Global steps in the current epoch."""
        self._load(self.epoch)
        return len(self._step_level)

    def level_of_step(self, step: int) -> int:
        """Packing level of global step `step` of the current epoch."""
        self._load(self.epoch)
        return int(self._step_level[step])

    def micro_batches_of_step(self, step: int) -> int:
        """Micro-batches per rank of global step `step` of the current epoch."""
        self._load(self.epoch)
        return int(self._first[step + 1] - self._first[step])

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its first step."""
        if epoch < 0:
            raise ValueError(f"BalancedBatchSampler: epoch must be >= 0, got {epoch}")
        self.epoch, self.step, self.micro = int(epoch), 0, 0

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            self._load(self.epoch)
            steps = len(self._step_level)
            if self.step >= steps:
                self.epoch, self.step, self.micro = self.epoch + 1, 0, 0
                continue
            if self.micro >= self.micro_batches_of_step(self.step):
                raise ValueError(f"BalancedBatchSampler: micro-batch {self.micro} of step "
                                 f"{self.step} (epoch {self.epoch}) does not exist")
            k = int(self._first[self.step]) + self.micro
            batch = self._samples[self._ptr[k]:self._ptr[k + 1]].tolist()
            self.last_level = int(self._step_level[self.step])
            self.last_epoch = self.epoch
            # Advance before yielding: state_dict() names the next micro-batch to train (the
            # next epoch's first once this one is done).
            self.micro += 1
            if self.micro == self.micro_batches_of_step(self.step):
                self.step, self.micro = self.step + 1, 0
            if self.step == steps:
                self.epoch, self.step = self.epoch + 1, 0
            yield batch

    def state_dict(self) -> dict:
        """Where the next micro-batch comes from, as plain ints (JSON-able)."""
        return {"epoch": self.epoch, "step": self.step, "micro": self.micro, "seed": self.seed,
                "dp_size": self.dp_size, "micro_batches": self.config.micro_batches}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` was taken; refuses a state from another layout."""
        for key, mine in (("dp_size", self.dp_size), ("seed", self.seed),
                          ("micro_batches", self.config.micro_batches)):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"BalancedBatchSampler: state has {key}={state[key]}, "
                                 f"this sampler {mine}")
        epoch, step, micro = int(state["epoch"]), int(state["step"]), int(state["micro"])
        if min(epoch, step, micro) < 0 or micro >= max(lv.micro_batches for lv in self.levels):
            raise ValueError(f"BalancedBatchSampler: bad position in state {state}")
        self.epoch, self.step, self.micro = epoch, step, micro
