"""The balanced Megatron data iterator (`--dataloader-type external`).

Megatron's schedule calls `next(data_iterator)` once per micro-batch on every pipeline rank. Each
rank builds its own iterator over the balanced sampler with its data-parallel rank, so all stages
of one pipeline read the same stream without a broadcast (the stage that merges image embeddings
needs the token ids, the last one the labels), and the ranks of a data-parallel group read
disjoint micro-batches.

Position: the sampler is deterministic given its seed, budgets and DP layout, and every training
step consumes exactly `micro_batches` micro-batches per rank, so the position after a checkpoint
is Megatron's own iteration counter, saved in every checkpoint. A resumed run walks the epochs
(each may have a different number of balanced steps) from the stream's origin (iteration 0 and
epoch 0, unless the data changed at a resume: data_identity.StreamOrigin) to the epoch and step
of that iteration and sees exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from megatron_omnibal.data.lengths import LengthsError, LengthStats
from megatron_omnibal.megatron.data_identity import StreamOrigin


class MicroBatchSampler(Protocol):
    """What the iterator needs of megatron_omnibal.data.sampler.BalancedBatchSampler."""

    steps_per_epoch: int

    def set_epoch(self, epoch: int) -> None: ...

    def load_state_dict(self, state: dict) -> None: ...

    def __iter__(self) -> Iterator[list[int]]: ...


class BalancedDataIterator:
    """This rank's collated micro-batches, starting at training step `start_step` (Megatron's
    iteration counter) of the stream that starts at `origin`."""

    def __init__(
        self,
        sampler: MicroBatchSampler,
        micro_batches: int,
        make_sample: Callable[[int], Any],
        collate: Callable[[list[Any]], Any],
        start_step: int = 0,
        filler: Callable[[], Any] | None = None,
        origin: StreamOrigin | None = None,
    ) -> None:
        if micro_batches <= 0:
            raise ValueError(f"micro_batches must be > 0, got {micro_batches}")
        if sampler.steps_per_epoch <= 0:
            raise ValueError(
                "the balanced sampler yields no training step per epoch "
                "(fewer samples than one step needs)"
            )
        self._sampler = sampler
        self._micro = micro_batches
        self._make_sample = make_sample
        self._collate = collate
        self._filler = filler
        self._consumed = 0
        self.origin = origin or StreamOrigin()
        if start_step < self.origin.iteration:
            raise ValueError(
                f"start step {start_step} lies before the stream's origin (iteration "
                f"{self.origin.iteration})"
            )
        self._indices = self._seek(start_step - self.origin.iteration, self.origin.epoch)
        self.start_step = start_step
        self.last_indices: list[int] = []  # the sample indices of the last micro-batch drawn

    def _seek(self, step: int, first_epoch: int) -> Iterator[list[int]]:
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
        return iter(self._sampler)

    @property
    def step(self) -> float:
        """Training steps consumed since step 0 (fractional inside a step)."""
        return self.start_step + self._consumed / self._micro

    def next_indices(self) -> list[int]:
        """The sample indices of the next micro-batch (advances the iterator, builds nothing)."""
        try:
            indices = next(self._indices)
        except StopIteration:
            raise RuntimeError(
                "the balanced sampler ran out of micro-batches at step "
                f"{self.step:g}; it must continue into later epochs"
            ) from None
        self._consumed += 1
        self.last_indices = list(indices)
        return self.last_indices

    def __iter__(self) -> BalancedDataIterator:
        return self

    def __next__(self) -> Any:
        step = int(self.step)
        indices = self.next_indices()
        if not indices:
            # The balancer leaves a pack empty only when the data has fewer samples than the
            # step's slots. Every pipeline stage must still run M micro-batches in lockstep: a
            # filler sample without loss tokens keeps the schedule and trains nothing.
            if self._filler is None:
                raise RuntimeError(f"empty micro-batch at step {step} and no filler sample to run")
            return self._collate([self._filler()])
        return self._collate([self._make_sample(i) for i in indices])


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
            f"text ({bad.size} such records); is --omnibal-data-tokens-per-tile right for this "
            "length file?"
        )
    text = np.maximum(-(-text // text_scale), 2)
    tokens = (text + lengths.image_flags * model_tokens_per_tile).astype(np.int64)
    return LengthStats(lengths.vit, tokens, lengths.image_flags, lengths.dataset, lengths.names)
