"""Forward step and per-token loss, for Megatron's schedules and megatron.training.pretrain.

Why per token: balanced micro-batches carry different numbers of samples and tokens; summing the
loss and counting tokens (calculate_per_token_loss=True) lets Megatron divide by the global token
count across micro-batches and data-parallel ranks, so every token weighs the same, whatever
the number of micro-batches of a step (packing levels run different counts per step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch

from megatron_omnibal.megatron.batch import MicroBatch


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


def forward_step(
    data_iterator: Iterator[MicroBatch | dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, Any]:
    """Run one micro-batch through this rank's stage; Megatron calls the returned loss function
    on the last stage. Every PP rank draws the same micro-batch from its iterator."""
    batch = _as_batch(next(data_iterator))
    if torch.cuda.is_available():
        batch = batch.to(torch.cuda.current_device())
    output = model(
        tokens=batch.tokens,
        position_ids=batch.position_ids,
        labels=batch.labels,
        images=batch.images,
        image_flags=batch.image_flags,
        cu_seqlens=batch.cu_seqlens,
        level=batch.level,
    )
    return output, partial(loss_func, batch.loss_mask)


def per_step_micro_batches(forward_backward_func: Callable[..., Any]) -> Callable[..., Any]:
    """The schedule, run for as many micro-batches as the data iterator's next step holds.

    megatron.training's train_step passes its run-wide get_num_microbatches() (ignored here);
    with packing levels a step runs its level's count, which only the balanced stream knows
    (BalancedDataIterator.micro_batches_of_next_step). megatron-core's schedules take the count
    per call, and with per-token loss the gradient is the same sum over tokens whatever it is.
    """

    def run(*, data_iterator: Any, num_microbatches: int, **kwargs: Any) -> Any:
        source = getattr(data_iterator, "iterable", data_iterator)  # Megatron's rerun wrapper
        return forward_backward_func(
            data_iterator=data_iterator,
            num_microbatches=source.micro_batches_of_next_step(),
            **kwargs,
        )

    return run
