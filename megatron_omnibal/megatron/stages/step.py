"""Forward step and per-token loss, for Megatron's schedules and megatron.training.pretrain.

Why per token: balanced micro-batches carry different numbers of samples and tokens; summing the
loss and counting tokens (calculate_per_token_loss=True) lets Megatron divide by the global token
count across micro-batches and data-parallel ranks, so every token weighs the same, whatever
the number of micro-batches of a step (packing levels run different counts per step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from megatron_omnibal.megatron.stages.families import tower_hooks
from megatron_omnibal.megatron.stream.batch import MicroBatch, validate_batch

if TYPE_CHECKING:
    from megatron_omnibal.models.spec import ModelSpec


def loss_func(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(sum of masked token losses, number of loss tokens, {"lm loss": [sum, tokens]})."""
    mask = loss_mask.reshape(-1).float()
    losses = output_tensor.reshape(-1).float()
    if losses.shape != mask.shape:
        raise ValueError(
            f"loss: {losses.numel()} per-token losses but {mask.numel()} loss-mask entries"
        )
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss_sum.detach().view(1), num_tokens.float().view(1)])
    return loss_sum, num_tokens, {"lm loss": report}


def _as_batch(item: MicroBatch | dict[str, torch.Tensor]) -> MicroBatch:
    return item if isinstance(item, MicroBatch) else MicroBatch.from_dict(item)


def stage_inputs(
    batch: MicroBatch, spec: ModelSpec, with_labels: bool = True
) -> tuple[MicroBatch, dict[str, Any]]:
    """(the batch on this rank's device, the stage module's keyword arguments).

    The batch is checked and its host-side facts (which tiles are real, the longest packed
    sample) are read on the CPU where the loader built it, before the copy to the GPU: the
    stage's forward then never waits on the device. Every pipeline rank checks the same
    micro-batch before any communication, so a bad one stops them all with the same error.
    """
    validate_batch(spec, batch.tokens, batch.labels, batch.images, batch.image_flags,
                   batch.cu_seqlens, batch.image_grid, batch.grid_seconds)  # fmt: skip
    real_tiles = torch.nonzero(batch.image_flags).flatten()
    max_seqlen = int((batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).max())
    native = tower_hooks(spec).attention_inputs(spec, batch.tokens, batch.cu_seqlens,
                                                batch.image_grid, batch.grid_seconds)
    if torch.cuda.is_available():
        device = torch.cuda.current_device()
        batch, real_tiles = batch.to(device), real_tiles.to(device, non_blocking=True)
        native = native.to(device) if native is not None else None
    return batch, {
        "native": native,
        "tokens": batch.tokens,
        "position_ids": batch.position_ids,
        "labels": batch.labels if with_labels else None,
        "images": batch.images,
        "real_tiles": real_tiles,
        "cu_seqlens": batch.cu_seqlens,
        "max_seqlen": max_seqlen,
        "level": batch.level,
    }


def forward_step(
    data_iterator: Iterator[MicroBatch | dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, Any]:
    """Run one micro-batch through this rank's stage; Megatron calls the returned loss function
    on the last stage. Every PP rank draws the same micro-batch from its iterator."""
    from megatron.core.utils import get_attr_wrapped_model

    spec = get_attr_wrapped_model(model, "spec")
    batch, inputs = stage_inputs(_as_batch(next(data_iterator)), spec)
    return model(**inputs), partial(loss_func, batch.loss_mask)


def per_step_micro_batches(forward_backward_func: Callable[..., Any]) -> Callable[..., Any]:
    """The schedule, run for as many micro-batches as the data iterator's next step holds.

    megatron.training's train_step passes its run-wide get_num_microbatches() (ignored here);
    with packing levels a step runs its level's count, which only the balanced stream knows
    (BalancedDataIterator.micro_batches_of_next_step). megatron-core's schedules take the count
    per call, and with per-token loss the gradient is the same sum over tokens whatever it is.
    """

    def run(*, data_iterator: Any, num_microbatches: int, **kwargs: Any) -> Any:
        # one iterator per model chunk under the interleaved schedule, all over one stream
        first = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
        source = getattr(first, "iterable", first)  # Megatron's rerun wrapper
        return forward_backward_func(
            data_iterator=data_iterator,
            num_microbatches=source.micro_batches_of_next_step(),
            **kwargs,
        )

    return run
