"""A tied output head with virtual stages (interleaved 1F1B): the copies of the word embedding
sit in whichever model chunks the layout gives the embedding and the head, two chunks of one
rank or chunks of two ranks.

Why not megatron-core's own: its finalize_model_grads sums the tied gradient over the embedding
group from one chunk per rank (model[0] on the first pipeline rank, model[-1] on the last,
model[0] elsewhere), which is right for one chunk per rank only; in a VLM the embedding sits
after the ViT, in any chunk. Here every chunk holding a copy takes part: a sum over the rank's
chunks, then over the embedding group (the ranks of the embedding's and the head's stages,
layout.embedding_ranks), the same for the starting weights and for each step's gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_attr_wrapped_model


def tied_copies(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The tied embedding's copies in a rank's model chunks (wrapped or not), in chunk order:
    the embedding's weight, the head's copy, or the one weight both use on one stage."""
    out = []
    for chunk in chunks:
        stage = get_attr_wrapped_model(chunk, "tied", return_model_obj=True)
        weight = stage.shared_embedding_or_output_weight()
        if stage.tied and weight is not None:
            out.append(weight)
    return out


def sum_copies(tensors: Sequence[torch.Tensor], group: Any = None) -> None:
    """Set each of this rank's `tensors` (one per copy) to the sum over all copies: the rank's
    own, then over `group` (default: the embedding group). A rank without copies does nothing
    (it is in no embedding group)."""
    if not tensors:
        return
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    if group is None:
        group = parallel_state.get_embedding_group(check_initialized=False)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(total, group=group)
    for t in tensors:
        t.copy_(total)


def tie_chunks(chunks: Sequence[torch.nn.Module]) -> None:
    """Once a rank has built all its chunks: the head's copies (built as zeros) take the
    embedding's weight, and every chunk's config finalizes gradients with finalize_tied_grads
    (megatron.training keeps a finalize function the model brings)."""
    with torch.no_grad():
        sum_copies([w.data for w in tied_copies(chunks)])
    for chunk in chunks:
        chunk.config.finalize_model_grads_func = finalize_tied_grads


def finalize_tied_grads(
    model: list[torch.nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    force_all_reduce: bool | None = False,
) -> None:
    """megatron-core's finalize_model_grads (the chunks do not ask it for its tied sum: their
    share_embeddings_and_output_weights is off), then the sum over every copy (sum_copies; of
    gradients it has scaled alike by the token count)."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    finalize_model_grads(model, num_tokens, pg_collection, force_all_reduce)
    copies = [w for w in tied_copies(model) if w.requires_grad]
    sum_copies([w.main_grad if hasattr(w, "main_grad") else w.grad for w in copies],
               None if pg_collection is None else pg_collection.embd)  # fmt: skip
