"""The balanced Megatron data iterator (`--dataloader-type external`).

Megatron's schedule calls `next(data_iterator)` once per micro-batch on every pipeline rank. Each
rank builds its own iterator over the balanced sampler with its data-parallel rank, so all stages
of one pipeline read the same stream without a broadcast (the stage that merges image embeddings
needs the token ids, the last one the labels), and the ranks of a data-parallel group read
disjoint micro-batches. Micro-batches are built by a torch DataLoader (loader.py): worker
processes, prefetch, pinned memory on GPUs, in exactly the sampler's order.

Position: the sampler is deterministic given its seed, budgets and DP layout, and every training
step consumes exactly the micro-batches of its step, so the position after a checkpoint is
Megatron's own iteration counter, saved in every checkpoint. A resumed run walks the epochs
(each may have a different number of balanced steps) from the stream's origin (iteration 0 and
epoch 0, unless the data changed at a resume: data_identity.StreamOrigin) to the epoch and step
of that iteration and sees exactly the batches the uninterrupted run would have seen.

Packing levels (hierarchical balance packing): every step draws from one level, whose
micro-batch count may differ from the run's. Each micro-batch carries its step's level, index
and count from the sampler through the loader (which draws ahead of training), so the training
loop asks `micro_batches_of_next_step()` before a step and the stage modules read the level of
the micro-batch they run.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Protocol

import numpy as np

from megatron_omnibal.balance.config import Level
from megatron_omnibal.data.lengths import LengthsError, LengthStats
from megatron_omnibal.megatron.stream.batch import MicroBatch, collate
from megatron_omnibal.megatron.stream.data_identity import StreamOrigin
from megatron_omnibal.megatron.stream.loader import (
    BadSamplePolicy,
    Draw,
    Loaded,
    MicroBatchDataset,
    identity,
)


class MicroBatchSampler(Protocol):
    """What the iterator needs of megatron_omnibal.balance.sampler.BalancedBatchSampler."""

    steps_per_epoch: int
    last_level: int
    last_epoch: int
    levels: tuple[Level, ...]

    def set_epoch(self, epoch: int) -> None: ...

    def load_state_dict(self, state: dict) -> None: ...

    def __iter__(self) -> Iterator[list[int]]: ...


class BalancedDataIterator:
    """This rank's micro-batches, starting at training step `start_step` (Megatron's iteration
    counter) of the stream that starts at `origin`.

    `micro_batches` is the run's count per step (the last level's); `num_workers` processes
    build them (0: in this process), `prefetch` micro-batches ahead per worker; `pin_memory`
    pins them for the copy to the GPU. `policy` decides what a sample that fails to load does
    (error, or skipped on every rank of the replica).
    """

    def __init__(
        self,
        sampler: MicroBatchSampler,
        micro_batches: int,
        dataset: MicroBatchDataset,
        start_step: int = 0,
        num_workers: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
        policy: BadSamplePolicy | None = None,
        origin: StreamOrigin | None = None,
    ) -> None:
        import torch.utils.data

        if micro_batches <= 0:
            raise ValueError(f"micro_batches must be > 0, got {micro_batches}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if sampler.steps_per_epoch <= 0:
            raise ValueError(
                "the balanced sampler yields no training step per epoch "
                "(fewer samples than one step needs)"
            )
        self._sampler = sampler
        self._micro = micro_batches
        self._dataset = dataset
        self._policy = policy or BadSamplePolicy()
        self._consumed = 0
        self.origin = origin or StreamOrigin()
        if start_step < self.origin.iteration:
            raise ValueError(
                f"start step {start_step} lies before the stream's origin (iteration "
                f"{self.origin.iteration})"
            )
        self.start_step = start_step
        self._seek(start_step - self.origin.iteration, self.origin.epoch)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=_Batches(sampler),
            collate_fn=identity,
            num_workers=num_workers,
            prefetch_factor=prefetch if num_workers else None,
            pin_memory=pin_memory,
            # The DataLoader draws its workers' base seed when iterated; from the global torch
            # RNG that draw would shift the dropout stream of a resumed run (its RNG state is
            # restored from the checkpoint before this iterator exists). Samples use no torch RNG.
            generator=torch.Generator(),
        )
        self._batches = iter(loader)
        self.last_indices: list[int] = []  # the sample indices of the last micro-batch drawn
        self.step = start_step  # the training step of the last micro-batch drawn
        self.level = 0  # its packing level
        self._left = 0  # micro-batches of that step still to draw
        self._ahead: Loaded | None = None  # drawn by micro_batches_of_next_step

    def _seek(self, step: int, first_epoch: int) -> None:
        """Position the sampler `step` training steps after the start of epoch `first_epoch`
        (epochs differ in length)."""
        if step < 0:
            raise ValueError(f"start step must be >= 0, got {step}")
        epoch, left = first_epoch, step
        while True:
            self._sampler.set_epoch(epoch)
            steps = self._sampler.steps_per_epoch
            if steps <= 0:
                raise ValueError(
                    f"the balanced sampler has no training step in epoch {epoch} "
                    "(fewer samples than one step needs)"
                )
            if left < steps:
                break
            epoch, left = epoch + 1, left - steps
        self._sampler.load_state_dict({"epoch": epoch, "step": left, "micro": 0})

    @property
    def policy(self) -> BadSamplePolicy:
        return self._policy

    def micro_batches_of_next_step(self) -> int:
        """Micro-batches of the step the next draw begins (its level's count): what the
        training loop runs as its next step. Call it between steps; it draws one ahead."""
        if self._left:
            raise RuntimeError(
                f"micro_batches_of_next_step: {self._left} micro-batch(es) of step {self.step} "
                "are still to be drawn"
            )
        if self._ahead is None:
            self._ahead = next(self._batches)
        return self._ahead.draw.micro_batches

    def __iter__(self) -> BalancedDataIterator:
        return self

    def __next__(self) -> MicroBatch:
        loaded, self._ahead = self._ahead or next(self._batches), None
        draw = loaded.draw
        if self._left == 0:  # the first micro-batch of a step
            if draw.micro != 0:
                raise RuntimeError(f"balanced stream out of step: micro-batch {draw.micro} of "
                                   f"{draw.micro_batches} drawn where a step begins")
            if self._consumed:
                self.step += 1
            self._left = draw.micro_batches
        self._left -= 1
        micro = self.start_step * self._micro + self._consumed
        self._consumed += 1
        self.last_indices = list(loaded.indices)
        self.level = draw.level
        batch = self._policy.resolve(micro, self.step, loaded)
        if batch is None:  # every sample of the pack failed and was skipped
            batch = collate([self._dataset.filler()])
        return replace(batch, level=draw.level)


class _Batches:
    """The sampler as the DataLoader's (endless) batch sampler, from its current position (a
    step's first micro-batch): each draw with its step's level, index and count."""

    def __init__(self, sampler: MicroBatchSampler) -> None:
        self._sampler = sampler

    def __iter__(self) -> Iterator[Draw]:
        micro = 0
        for indices in self._sampler:
            level = self._sampler.last_level
            count = self._sampler.levels[level].micro_batches
            yield Draw(list(indices), level, micro, count, self._sampler.last_epoch)
            micro = (micro + 1) % count


def model_lengths(
    lengths: LengthStats, data_tokens_per_tile: int, model_tokens_per_tile: int, text_scale: int = 1
) -> LengthStats:
    """The lengths as the model sees them, which is what the balancer must balance.

    A length file counts `data_tokens_per_tile` image tokens per real tile in token_num (InternVL:
    256); the model has its own count per tile. Text tokens may be divided by `text_scale` (rounded
    up, at least 2: BOS and one answer token) so long real data can be dry-run on a CPU.
    """
    if data_tokens_per_tile < 0 or model_tokens_per_tile <= 0 or text_scale <= 0:
        raise ValueError(
            f"tokens per tile ({data_tokens_per_tile}, {model_tokens_per_tile}) and text scale "
            f"({text_scale}) must be positive"
        )
    text = lengths.tokens - lengths.image_flags * data_tokens_per_tile
    bad = np.flatnonzero(text < 1)
    if bad.size:
        i = int(bad[0])
        raise LengthsError(
            f"length record {i}: token_num {int(lengths.tokens[i])} does not hold its "
            f"{int(lengths.image_flags[i])} real tiles x {data_tokens_per_tile} image tokens plus "
            f"text ({bad.size} such records); the length file was counted for another model "
            "(its stored stats configuration says how many image tokens a tile has)"
        )
    text = np.maximum(-(-text // text_scale), 2)
    tokens = (text + lengths.image_flags * model_tokens_per_tile).astype(np.int64)
    return LengthStats(lengths.vit, tokens, lengths.image_flags, lengths.dataset, lengths.names)
