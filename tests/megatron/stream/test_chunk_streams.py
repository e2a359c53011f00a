"""A rank's balanced stream read by its model chunks (interleaved 1F1B): every chunk reads every
micro-batch in order, with the stream's facts about it, whatever order the chunks draw in."""

import pytest

from megatron_omnibal.megatron.stream.chunk_streams import SharedStream


class Counting:
    """A stream of steps of 2 micro-batches that counts its draws (a BalancedDataIterator's
    facts and its between-steps question)."""

    start_step = 5

    def __init__(self) -> None:
        self.drawn = 0

    def __next__(self) -> int:
        self.drawn += 1
        self.last_indices, self.step, self.level = [self.drawn], 5 + (self.drawn - 1) // 2, 0
        return self.drawn

    def micro_batches_of_next_step(self) -> int:
        return 2


def test_each_chunk_reads_every_micro_batch_once_loaded_once() -> None:
    source, stream = Counting(), SharedStream(3)
    views = [stream.attach(source), stream.view(1), stream.view(2)]
    # the interleaved schedule's order on one rank: chunk 0 ahead, then the later chunks
    order = [0, 0, 1, 0, 1, 2, 0, 2, 1, 2, 1, 2]
    got = {c: [] for c in range(3)}
    for c in order:
        got[c].append((next(views[c]), views[c].last_indices, views[c].step))
    want = [(k, [k], 5 + (k - 1) // 2) for k in range(1, 5)]
    assert got == {0: want, 1: want, 2: want}
    assert source.drawn == 4  # loaded once, read three times
    assert views[2].start_step == 5
    assert views[1].micro_batches_of_next_step() == 2


def test_the_next_step_is_asked_only_when_every_chunk_has_caught_up() -> None:
    stream = SharedStream(2)
    first = stream.attach(Counting())
    next(first)
    with pytest.raises(RuntimeError, match=r"model chunks \[1\] have not read"):
        first.micro_batches_of_next_step()
    with pytest.raises(ValueError, match="chunk 2 of 2"):
        stream.view(2)
