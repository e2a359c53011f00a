"""What every training step of the balanced stream carries, on every data-parallel rank.

Why: the balancer is deterministic, so any process can compute, without communication, how many
samples, image tiles and tokens each DP rank trains at any step. That gives Megatron's "consumed
samples" in samples (Megatron itself counts micro-batches, i.e. packs), the per-step balance
figures of the training log, and the start-up summary, all equal on every rank.

Pure numpy over the balancer's epoch plans: no torch, no Megatron.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megatron_omnibal.balance.plan_io import BalancePlan
from megatron_omnibal.data.lengths import LengthStats
from megatron_omnibal.megatron.stream.data_identity import StreamOrigin


@dataclass(frozen=True)
class StepFigures:
    """One training step: per DP rank, the samples, tiles and tokens of its micro-batches and
    the sum of its samples' squared token lengths (what packed causal attention costs)."""

    samples: np.ndarray  # [dp]
    tiles: np.ndarray  # [dp]
    tokens: np.ndarray  # [dp]
    sumsq: np.ndarray  # [dp]

    @property
    def num_samples(self) -> int:
        return int(self.samples.sum())

    @property
    def num_tiles(self) -> int:
        return int(self.tiles.sum())

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.sum())


def max_over_mean(per_rank: np.ndarray) -> float:
    """Largest rank load over the mean rank load (1.0: perfectly balanced or nothing to do)."""
    mean = float(per_rank.mean())
    return float(per_rank.max()) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class EpochSteps:
    """Per (step, rank) sums of one epoch's plan: int64 arrays of shape [steps, dp]."""

    samples: np.ndarray
    tiles: np.ndarray
    tokens: np.ndarray
    sumsq: np.ndarray

    @property
    def num_steps(self) -> int:
        return len(self.samples)

    def step(self, index: int) -> StepFigures:
        return StepFigures(
            self.samples[index], self.tiles[index], self.tokens[index], self.sumsq[index]
        )


def epoch_steps(plan: BalancePlan, lengths: LengthStats) -> EpochSteps:
    """The per (step, rank) samples, tiles and tokens of one epoch's plan: each sample's value
    summed into its pack (one pass over the samples, pack after pack), the packs into their
    (step, rank)."""
    dp, steps = int(plan.meta["dp"]), plan.num_steps
    slot = plan.pack_step * dp + plan.pack_rank

    def per_step(per_sample: np.ndarray) -> np.ndarray:
        running = np.concatenate([[0], np.cumsum(per_sample, dtype=np.int64)])
        per_pack = running[plan.pack_ptr[1:]] - running[plan.pack_ptr[:-1]]
        return np.rint(np.bincount(slot, per_pack, steps * dp)).astype(np.int64).reshape(steps, dp)

    tokens = lengths.tokens[plan.samples].astype(np.int64, copy=False)
    return EpochSteps(
        per_step(np.ones(len(plan.samples), np.int64)),
        per_step(lengths.vit[plan.samples]),
        per_step(tokens),
        per_step(tokens * tokens),
    )


class StreamSteps:
    """The steps of a run's stream, addressed by Megatron iteration.

    Megatron iteration `origin.iteration + k` trains the stream's step k, counted from the first
    step of epoch `origin.epoch`; epochs follow each other, each with its own number of steps.
    `plan_of_epoch(e)` is the balancer's whole plan (all DP ranks) of epoch e; `lengths_of(e)`
    the samples' lengths in epoch e (videos train on a number of frames drawn per epoch).
    `steps_of_epoch(e)`: epoch_steps of epoch e made elsewhere (node_plans: once per node;
    None: summed here from the plan and lengths).
    """

    _CACHED_EPOCHS = 2

    def __init__(
        self,
        plan_of_epoch: Callable[[int], BalancePlan],
        lengths_of: Callable[[int], LengthStats],
        origin: StreamOrigin | None = None,
        steps_of_epoch: Callable[[int], EpochSteps] | None = None,
    ) -> None:
        self._plan_of_epoch = plan_of_epoch
        self._lengths_of = lengths_of
        self._steps_of_epoch = steps_of_epoch
        self.origin = origin or StreamOrigin()
        self._epochs: OrderedDict[int, EpochSteps] = OrderedDict()
        self._totals: dict[int, tuple[int, int]] = {}  # epoch -> (steps, samples)

    def epoch(self, epoch: int) -> EpochSteps:
        """The per-step figures of balancer epoch `epoch` (the last few are kept)."""
        if epoch in self._epochs:
            self._epochs.move_to_end(epoch)
            return self._epochs[epoch]
        if self._steps_of_epoch is not None:
            steps = self._steps_of_epoch(epoch)
        else:
            steps = epoch_steps(self._plan_of_epoch(epoch), self._lengths_of(epoch))
        if steps.num_steps <= 0:
            raise ValueError(
                f"the balanced stream has no training step in epoch {epoch} "
                "(fewer samples than one step needs)"
            )
        self._epochs[epoch] = steps
        self._totals[epoch] = (steps.num_steps, int(steps.samples.sum()))
        while len(self._epochs) > self._CACHED_EPOCHS:
            self._epochs.popitem(last=False)
        return steps

    def _steps_and_samples(self, epoch: int) -> tuple[int, int]:
        if epoch not in self._totals:
            self.epoch(epoch)
        return self._totals[epoch]

    def locate(self, iteration: int) -> tuple[int, int]:
        """(balancer epoch, step within it) that Megatron iteration `iteration` trains (the
        iteration counter before the step: 0 for the first step of a fresh run)."""
        left = self._stream_step(iteration)
        epoch = self.origin.epoch
        while True:
            steps, _ = self._steps_and_samples(epoch)
            if left < steps:
                return epoch, left
            epoch, left = epoch + 1, left - steps

    def step(self, iteration: int) -> StepFigures:
        """The figures of the step Megatron runs at iteration counter `iteration`."""
        epoch, index = self.locate(iteration)
        return self.epoch(epoch).step(index)

    def consumed_samples(self, iteration: int) -> int:
        """Samples trained (all DP ranks) once Megatron's iteration counter reaches
        `iteration`: the origin's count plus every stream step before it."""
        left = self._stream_step(iteration)
        total, epoch = self.origin.consumed_samples, self.origin.epoch
        while left:
            steps, samples = self._steps_and_samples(epoch)
            if left < steps:
                return total + int(self.epoch(epoch).samples[:left].sum())
            total, left, epoch = total + samples, left - steps, epoch + 1
        return total

    def _stream_step(self, iteration: int) -> int:
        step = iteration - self.origin.iteration
        if step < 0:
            raise ValueError(
                f"iteration {iteration} lies before the stream's origin (iteration "
                f"{self.origin.iteration})"
            )
        return step
