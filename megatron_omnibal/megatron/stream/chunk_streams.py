"""One rank's balanced stream, read by each of its model chunks (interleaved 1F1B).

Why: Megatron's interleaved schedule takes one data iterator per model chunk and draws micro-batch
k once per chunk; every chunk needs the same micro-batches (the chunk that merges images reads
the token ids, the head's chunk the labels). The stream is loaded once and each chunk reads it
through its own view; a micro-batch is kept until the last chunk has read it (chunk 0 runs ahead
by at most the schedule's warm-up). Between steps every chunk has read the same count, which is
when the training loop asks how many micro-batches the next step holds. A view tells, as the
stream does, the sample indices, step and level of the micro-batch it last read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

# What BalancedDataIterator tells of the micro-batch it last drew.
FACTS = ("last_indices", "step", "level")


class SharedStream:
    """`chunks` views of one iterator (attach it, then hand out `view(c)` per chunk)."""

    def __init__(self, chunks: int) -> None:
        if chunks < 1:
            raise ValueError(f"SharedStream: {chunks} chunks")
        self._source: Any = None
        self._waiting: list[deque[Any]] = [deque() for _ in range(chunks)]

    def attach(self, source: Any) -> ChunkView:
        """Read `source` (a BalancedDataIterator); returns chunk 0's view."""
        self._source = source
        return self.view(0)

    def view(self, chunk: int) -> ChunkView:
        if not 0 <= chunk < len(self._waiting):
            raise ValueError(f"SharedStream: chunk {chunk} of {len(self._waiting)}")
        return ChunkView(self, chunk)

    @property
    def start_step(self) -> int:
        return self._source.start_step

    def next_for(self, chunk: int) -> tuple[Any, dict[str, Any]]:
        """Chunk `chunk`'s next micro-batch and the stream's facts about it."""
        if self._source is None:
            raise RuntimeError("SharedStream: no iterator attached (chunk 0's is built first)")
        waiting = self._waiting[chunk]
        if not waiting:
            item = next(self._source)
            facts = {key: getattr(self._source, key) for key in FACTS}
            for queue in self._waiting:
                queue.append((item, facts))
        return waiting.popleft()

    def micro_batches_of_next_step(self) -> int:
        behind = [c for c, queue in enumerate(self._waiting) if queue]
        if behind:
            raise RuntimeError(
                f"model chunks {behind} have not read every micro-batch of the last step: the "
                "schedule drew unequal counts per chunk"
            )
        return self._source.micro_batches_of_next_step()


class ChunkView:
    """One model chunk's iterator over the shared stream."""

    def __init__(self, stream: SharedStream, chunk: int) -> None:
        self.stream, self.chunk = stream, chunk
        self.last_indices: list[int] = []
        self.step = stream.start_step if stream._source is not None else 0
        self.level = 0

    @property
    def start_step(self) -> int:
        return self.stream.start_step

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        item, facts = self.stream.next_for(self.chunk)
        for key, value in facts.items():
            setattr(self, key, value)
        return item

    def micro_batches_of_next_step(self) -> int:
        return self.stream.micro_batches_of_next_step()
