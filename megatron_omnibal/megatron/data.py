"""The balanced Megatron data iterator (`--dataloader-type external`).

Megatron's schedule calls `next(data_iterator)` once per micro-batch on every pipeline rank. Each
rank builds its own iterator over the balanced sampler with its data-parallel rank, so all stages
of one pipeline read the same stream without a broadcast (the stage that merges image embeddings
needs the token ids, the last one the labels), and the ranks of a data-parallel group read
disjoint micro-batches. Micro-batches are built by a torch DataLoader (loader.py): worker
processes, prefetch, pinned memory on GPUs, in exactly the sampler's order.

Position: the sampler is deterministic given its seed, budgets and DP layout, and every training
step consumes exactly `micro_batches` micro-batches per rank, so the position after a checkpoint
is Megatron's own iteration counter, saved in every checkpoint. A resumed run walks the epochs
(each may have a different number of balanced steps) from the stream's origin (iteration 0 and
epoch 0, unless the data changed at a resume: data_identity.StreamOrigin) to the epoch and step
of that iteration and sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import numpy as np

from megatron_omnibal.data.lengths import LengthsError, LengthStats
from megatron_omnibal.megatron.batch import MicroBatch, collate
from megatron_omnibal.megatron.data_identity import StreamOrigin
from megatron_omnibal.megatron.loader import BadSamplePolicy, MicroBatchDataset, identity


class MicroBatchSampler(Protocol):
    """What the iterator needs of megatron_omnibal.balance.sampler.BalancedBatchSampler."""

    steps_per_epoch: int
    last_level: int

    def set_epoch(self, epoch: int) -> None: ...

    def load_state_dict(self, state: dict) -> None: ...

    def __iter__(self) -> Iterator[list[int]]: ...


class BalancedDataIterator:
    """This rank's micro-batches, starting at training step `start_step` (Megatron's iteration
    counter) of the stream that starts at `origin`.

    `num_workers` processes build them (0: in this process), `prefetch` micro-batches ahead
    per worker; `pin_memory` pins them for the copy to the GPU. `policy` decides what a
    sample that fails to load does (error, or skipped on every rank of the replica).
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
    def level(self) -> int:
        """Packing level of the last micro-batch drawn (its step's level: the stage modules
        switch their recompute to that level's counts, BalanceConfig.all_levels)."""
        return self._sampler.last_level

    @property
    def step(self) -> float:
        """Training steps consumed since step 0 (fractional inside a step)."""
        return self.start_step + self._consumed / self._micro

    @property
    def policy(self) -> BadSamplePolicy:
        return self._policy

    def __iter__(self) -> BalancedDataIterator:
        return self

    def __next__(self) -> MicroBatch:
        step = int(self.step)
        micro = self.start_step * self._micro + self._consumed
        loaded = next(self._batches)
        self._consumed += 1
        self.last_indices = list(loaded.indices)
        batch = self._policy.resolve(micro, step, loaded)
        if batch is None:  # every sample of the pack failed and was skipped
            batch = collate([self._dataset.filler()])
        return batch


class _Batches:
    """The sampler as the DataLoader's (endless) batch sampler, from its current position."""

    def __init__(self, sampler: MicroBatchSampler) -> None:
        self._sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._sampler)


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
