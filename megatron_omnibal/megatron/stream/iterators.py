"""The iterators megatron.training asks its datasets provider for: one balanced stream per rank.

Why here, not in the entry point: the training run, the preflight and the benchmarks build the
same stream from the run's settings (megatron/flags/args.py's OmnibalSettings, read by
attribute: this room stands below the flags), so it has one home. Torch and megatron-core are
imported inside the functions that run once the process groups exist.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from megatron_omnibal.megatron.runtime.stderr import write_line


@dataclass(frozen=True)
class StageRanks:
    """This rank's place in the model-parallel grid, as the data stream needs it."""

    dp: int
    pp: int
    tp: int
    model_size: int  # PP x TP: the ranks that read one replica's stream


def balanced_sampler(settings: Any, dp_rank: int, plans: Any = None) -> Any:
    """The balanced sampler of one DP rank (its `plan(epoch)` is every rank's plan), with each
    epoch's lengths: a length file with videos draws their frames per epoch from the balance
    seed (data/video_lengths.py), the same on every rank and at every resume. `plans`: the
    epoch plans (node_plans; None: balanced in this process)."""
    from megatron_omnibal.balance.sampler import BalancedBatchSampler

    return BalancedBatchSampler(
        settings.lengths, settings.balance, dp_rank=dp_rank, lengths_of_epoch=settings.by_epoch,
        plan_of_epoch=plans,
    )  # fmt: skip


def node_plans(settings: Any, resume: Any) -> Any:
    """The run's epoch plans, balanced once per node (node_plans.NodePlans; the local rank
    from torchrun's LOCAL_RANK); `resume` is the run's ResumePlan."""
    from megatron_omnibal.megatron.stream.node_plans import NodePlans

    return NodePlans(
        settings.by_epoch,
        settings.balance,
        resume.identity.to_dict(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def chunk_streams(settings: Any) -> Any:
    """The stream shared by a rank's model chunks (None with one chunk per rank)."""
    from megatron_omnibal.megatron.stream.chunk_streams import SharedStream

    return SharedStream(settings.vpp) if settings.vpp > 1 else None


def build_data_iterators(
    settings: Any,
    spec: Any,
    _num_samples: Any = None,
    *,
    iteration: Callable[[], int],
    origin: Any = None,
    plans: Any = None,
    source: Any = None,
    chunks: Any = None,
    vp_stage: int | None = None,
) -> tuple[Any, None, None]:
    """(train iterator, no validation, no test) for this rank, at Megatron's iteration (read by
    `iteration()` once Megatron loaded its checkpoint) of the stream that starts at `origin`
    (data_identity.StreamOrigin; None: iteration 0, epoch 0).
    `plans`: the run's epoch plans (node_plans; None: balanced in this process); `source`: the
    data source the start-up opened (None: opened here for a real dataset). With model chunks
    (interleaved 1F1B) megatron.training asks once per chunk (`vp_stage`): chunk 0's call
    builds the stream, the others read it through `chunks` (chunk_streams.SharedStream).

    Only ranks whose stage holds the patch embedding decode pixels; the others get token ids,
    labels and shape-only tiles. Micro-batches come from Megatron's --num-workers processes on
    the ranks that decode pixels; the others build them in the training process (they only
    tokenize: a worker's hand-over costs them more than the work, and each worker process
    holds a few hundred MB).
    """
    import atexit

    from megatron.core import parallel_state

    if vp_stage:
        return chunks.view(vp_stage), None, None
    ranks = StageRanks(
        dp=parallel_state.get_data_parallel_rank(),
        pp=parallel_state.get_pipeline_model_parallel_rank(),
        tp=parallel_state.get_tensor_model_parallel_rank(),
        model_size=parallel_state.get_pipeline_model_parallel_world_size()
        * parallel_state.get_tensor_model_parallel_world_size(),
    )
    # Megatron's iteration once it loaded its checkpoint: where this rank's stream resumes
    iterator, policy = data_iterator(
        settings, spec, ranks, iteration(), origin=origin, plans=plans, source=source
    )
    atexit.register(_report_skipped, policy)
    return (iterator if chunks is None else chunks.attach(iterator)), None, None


def data_iterator(
    settings: Any,
    spec: Any,
    ranks: StageRanks,
    start_step: int,
    *,
    origin: Any = None,
    plans: Any = None,
    source: Any = None,
) -> tuple[Any, Any]:
    """(this rank's balanced iterator from Megatron iteration `start_step`, its bad-sample
    policy): build_data_iterators once the process groups say where the rank stands."""
    import torch

    from megatron_omnibal.megatron.stream.batch import SyntheticSamples
    from megatron_omnibal.megatron.stream.data import BalancedDataIterator
    from megatron_omnibal.megatron.stream.loader import MicroBatchDataset

    by_epoch = settings.by_epoch
    sampler = balanced_sampler(settings, ranks.dp, plans)
    pixels = settings.decodes_pixels(ranks.pp)
    if settings.data == "synthetic":
        make_sample = SyntheticSamples(by_epoch, spec, seed=settings.seed, pixels=pixels)
        describe = str
    else:
        if source is None:
            from megatron_omnibal.megatron.stream.dataset import open_source

            source = open_source(
                settings.source, settings.lengths, spec, pixels=pixels, check=0, by_epoch=by_epoch
            )
        source.pixels = pixels
        make_sample = source
        describe = make_sample.describe
    workers = settings.num_workers if pixels else 0
    if workers:
        # The worker processes are the parallelism; a forked tokenizer's thread pool is not.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    most = max(lv.micro_batches for lv in settings.balance.all_levels)  # per step
    policy = bad_sample_policy(settings, ranks, pixels, describe, most)
    iterator = BalancedDataIterator(
        sampler,
        settings.micro_batches,
        MicroBatchDataset(make_sample, partial(filler_sample, spec)),
        start_step=start_step,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        policy=policy,
        origin=origin,
    )
    return iterator, policy


def bad_sample_policy(
    settings: Any, ranks: StageRanks, pixels: bool, describe: Any, micro_batches: int
) -> Any:
    """The skip/error policy of this rank; under skip, the decoding rank of each replica (first
    stage, TP rank 0) tells the other ranks through the job's store which samples failed."""
    from megatron_omnibal.megatron.stream.loader import (
        BadSampleChannel,
        BadSamplePolicy,
        report_path,
    )

    decides = pixels and ranks.tp == 0
    channel = None
    if settings.bad_sample == "skip" and ranks.model_size > 1:
        import torch.distributed as dist

        # the decision of micro-batch k is read before step k/M + 2 ends: keep three steps
        channel = BadSampleChannel(
            dist.distributed_c10d._get_default_store(), ranks.dp, 3 * micro_batches
        )
    report = None
    if decides:
        report = report_path(
            settings.bad_sample_report, settings.save, settings.dp_size, ranks.dp
        )
    return BadSamplePolicy(
        mode=settings.bad_sample,
        decides=decides,
        channel=channel,
        report=report,
        describe=describe,
    )  # fmt: skip


def _report_skipped(policy: Any) -> None:
    summary = policy.summary()
    if summary:
        write_line(summary)


def filler_sample(spec: Any) -> Any:
    """A sample that trains nothing: a BOS token without loss, one dummy (image_flags 0) tile,
    like InternVL's text-only samples (native-resolution models: no image). It stands in for an
    empty balanced pack."""
    import torch

    from megatron_omnibal.megatron.stream.batch import IGNORE_INDEX, Sample

    size = spec.vit.image_size
    if spec.vit.native_resolution:  # no image at all (a native tower has no dummy tiles)
        return Sample(
            tokens=torch.zeros(1, dtype=torch.int64),
            labels=torch.full((1,), IGNORE_INDEX, dtype=torch.int64),
            images=torch.zeros(0, spec.vit.patch_dim),
            image_flags=torch.zeros(0, dtype=torch.int64),
            image_grid=torch.zeros(0, 3, dtype=torch.int64),
        )
    return Sample(
        tokens=torch.zeros(1, dtype=torch.int64),
        labels=torch.full((1,), IGNORE_INDEX, dtype=torch.int64),
        images=torch.zeros(1, 3, size, size),
        image_flags=torch.zeros(1, dtype=torch.int64),
    )
