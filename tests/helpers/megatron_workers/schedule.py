"""One training step's forwards and backwards through megatron-core's real pipeline schedule."""

from __future__ import annotations

from typing import Any


def run_schedule(forward_step_func: Any, model: Any, batches: list) -> Any:
    """Megatron's schedule for this rank's stage over `batches` (one micro-batch each):
    per-micro-batch loss reports on the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=max(b.tokens.shape[1] for b in batches),
        micro_batch_size=1,
    )
