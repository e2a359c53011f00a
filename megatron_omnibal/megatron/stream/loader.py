"""Micro-batches built in DataLoader worker processes, and what happens to a sample that fails.

Why workers: decoding, resizing and tiling the images of a micro-batch costs far more CPU time
than a training step leaves on the training thread. A torch DataLoader over the balanced
sampler (the sampler is the DataLoader's batch sampler) builds micro-batches in `num_workers`
processes, `prefetch_factor` ahead, pinned on GPU machines. The DataLoader hands batches back in
the order the sampler drew them, whatever the number of workers, so the stream is identical
with 0, 1 or N workers.

A sample whose images cannot be loaded (missing, truncated, a decompression bomb) is a
`failure` of its micro-batch, never a traceback inside a worker. Under `bad_sample="error"` the
training process stops naming it; under "skip" it is left out of the micro-batch on every
pipeline and tensor-parallel rank of its data-parallel replica: only the rank that decodes
pixels (first pipeline stage, TP rank 0) knows, so it publishes the decision per micro-batch
through the job's key-value store (torch.distributed's rendezvous store), and the other ranks,
which reach that micro-batch only after it, read it there. Each skipped sample is logged with
its id, counted, and appended to a JSONL report.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_omnibal.megatron.runtime.stderr import write_line
from megatron_omnibal.megatron.stream.batch import MicroBatch, Sample, collate, drop_samples

BAD_SAMPLE = ("error", "skip")


class SampleLoadError(ValueError):
    """A sample whose data (an image) cannot be loaded; the message names the sample."""


@dataclass(frozen=True)
class Draw:
    """One micro-batch as the sampler drew it: its samples, and its place in its step: the
    step's packing level, its index in the step and the step's micro-batch count. The loader
    draws ahead of training, so the step's size and level must travel with each draw."""

    indices: list[int]
    level: int = 0
    micro: int = 0
    micro_batches: int = 1
    epoch: int = 0  # the balancer epoch: a video sample trains on that epoch's frames


@dataclass
class Loaded:
    """One micro-batch as a worker built it: the packed batch of the samples that loaded,
    their positions in the drawn list, and the failures (position, reason)."""

    draw: Draw
    batch: MicroBatch | None
    kept: list[int]
    tiles: list[int]  # tiles per kept sample, in batch order
    failures: list[tuple[int, str]] = field(default_factory=list)
    fatal: str | None = None  # a configuration error (not one sample's data): stop

    @property
    def indices(self) -> list[int]:
        return self.draw.indices

    def pin_memory(self) -> Loaded:
        if self.batch is not None:
            self.batch = self.batch.pin_memory()
        return self


class MicroBatchDataset:
    """The DataLoader's dataset: a `Draw` in, a `Loaded` micro-batch out.

    `make_sample(i, epoch)` builds sample i as epoch `epoch` trains it (raising SampleLoadError
    when its data cannot be loaded, any other ValueError for a configuration problem);
    `filler()` stands in for an empty pack.
    """

    def __init__(self, make_sample: Callable[[int, int], Sample],
                 filler: Callable[[], Sample]) -> None:
        self.make_sample = make_sample
        self.filler = filler

    def __getitems__(self, draw: Draw) -> Loaded:  # the batch sampler yields Draws
        return self.load(draw)

    def __getitem__(self, index: int) -> Loaded:  # the DataLoader only calls __getitems__
        return self.load(Draw([index]))

    def load(self, draw: Draw) -> Loaded:
        samples, kept, failures = [], [], []
        try:
            for pos, index in enumerate(draw.indices):
                try:
                    samples.append(self.make_sample(index, draw.epoch))
                    kept.append(pos)
                except SampleLoadError as exc:
                    failures.append((pos, str(exc)))
            batch = collate(samples) if samples else None
        except ValueError as exc:  # the data does not fit its length file or the model
            return Loaded(draw, None, [], [], failures, fatal=str(exc))
        if not draw.indices:  # an empty pack: a filler without loss tokens keeps the schedule
            batch = collate([self.filler()])
        return Loaded(draw, batch, kept, [len(s.images) for s in samples], failures)


def identity(loaded: Loaded) -> Loaded:
    """collate_fn: the dataset already packs the micro-batch (a module-level function, so
    worker processes can receive it)."""
    return loaded


class BadSampleChannel:
    """Per-micro-batch skip decisions from the decoding rank to the others of its replica."""

    def __init__(self, store: Any, dp_rank: int, keep: int) -> None:
        self.store = store
        self.prefix = f"omnibal/bad/{dp_rank}/"
        self.keep = keep  # decisions older than this many micro-batches are deleted

    def publish(self, micro: int, positions: list[int]) -> None:
        self.store.set(f"{self.prefix}{micro}", json.dumps(positions))
        if micro >= self.keep:
            self.store.delete_key(f"{self.prefix}{micro - self.keep}")

    def receive(self, micro: int) -> list[int]:
        return json.loads(self.store.get(f"{self.prefix}{micro}"))


@dataclass
class BadSamplePolicy:
    """What this rank does with failed samples (see the module docstring)."""

    mode: str = "error"
    decides: bool = True  # this rank decodes pixels and is TP rank 0: it decides
    channel: BadSampleChannel | None = None  # None: no other rank to tell (PP = TP = 1)
    report: Path | None = None
    describe: Callable[[int], str] = str
    skipped: int = 0

    def __post_init__(self) -> None:
        if self.mode not in BAD_SAMPLE:
            raise ValueError(f"bad-sample policy must be one of {', '.join(BAD_SAMPLE)}, "
                             f"got {self.mode!r}")

    def resolve(self, micro: int, step: int, loaded: Loaded) -> MicroBatch:
        """The micro-batch to train, with the failed samples of this replica left out."""
        if loaded.fatal is not None:
            raise SampleLoadError(loaded.fatal)
        if self.mode == "error":
            if loaded.failures:
                pos, reason = loaded.failures[0]
                raise SampleLoadError(
                    f"{reason} (--omnibal-bad-sample skip leaves such samples out and reports "
                    "them)")
            return loaded.batch
        mine = [pos for pos, _ in loaded.failures]
        if self.decides:
            bad = mine
            if self.channel is not None:
                self.channel.publish(micro, bad)
            for pos, reason in loaded.failures:
                self._log(step, loaded.indices[pos], reason)
        else:
            bad = self.channel.receive(micro) if self.channel is not None else mine
            if set(mine) - set(bad):
                pos = sorted(set(mine) - set(bad))[0]
                raise SampleLoadError(
                    f"{dict(loaded.failures)[pos]}: it failed on this rank but loaded on the "
                    "rank that decides (first pipeline stage, tensor-parallel rank 0)")
        drop = [loaded.kept.index(p) for p in bad if p in loaded.kept]
        batch = drop_samples(loaded.batch, drop, loaded.tiles) if drop else loaded.batch
        return batch

    def _log(self, step: int, index: int, reason: str) -> None:
        self.skipped += 1
        where = self.describe(index)
        write_line(f"pretrain_vlm: skipped {where} at step {step}: {reason}")
        if self.report is not None:
            self.report.parent.mkdir(parents=True, exist_ok=True)
            entry = {"step": step, "index": index, "sample": where, "reason": reason}
            with open(self.report, "a") as fh:
                fh.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def summary(self) -> str | None:
        if not self.skipped:
            return None
        report = f"; report: {self.report}" if self.report is not None else ""
        return (f"pretrain_vlm: {self.skipped} sample(s) could not be loaded and were "
                f"skipped{report}")


def report_path(report: str | None, save: str | None, dp_size: int, dp_rank: int) -> Path:
    """The skipped-sample report of a data-parallel replica: `report`
    (--omnibal-bad-sample-report), else next to the checkpoints (`save`), else the working
    directory."""
    base = Path(report) if report else Path(save or os.getcwd()) / "omnibal_bad_samples.jsonl"
    return base.with_name(f"{base.stem}.dp{dp_rank}{base.suffix}") if dp_size > 1 else base
