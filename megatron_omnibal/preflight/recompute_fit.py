"""The recompute that would let a stage fit, from what the preflight measured on it.

Megatron recomputes the first k layers of a stage's ViT and of its LLM block. Recomputing one
more layer frees, in each of the micro-batches the stage holds at its peak, the activations that
layer stored less its input (which the checkpoint keeps), and costs one more forward of it in the
backward, while that one layer's activations exist again for a moment. Every figure here is
measured per layer on the stage's largest micro-batch (measure.StepMeter); none is modeled.
Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LayerMeasure:
    """One layer on its largest micro-batch: stored activations and input (GiB), forward ms."""

    activation_gib: float
    input_gib: float
    forward_ms: float


def fitting_recompute(
    *,
    static_gib: float,
    activation_gib: float,
    inflight: int,
    vit: Sequence[LayerMeasure],
    llm: Sequence[LayerMeasure],
    vit_now: int,
    llm_now: int,
    limit_gib: float,
) -> tuple[int, int] | None:
    """(ViT, LLM) layers to recompute, at least the current ones, whose estimated peak is within
    `limit_gib`, the cheapest in added forward time; None when recomputing every layer does not
    fit. `activation_gib` is the stage's measured activation peak with the current recompute,
    `inflight` the micro-batches it holds then."""
    best: tuple[float, tuple[int, int]] | None = None
    for v in range(vit_now, len(vit) + 1):
        for n in range(llm_now, len(llm) + 1):
            new = [*vit[vit_now:v], *llm[llm_now:n]]
            freed = inflight * sum(max(m.activation_gib - m.input_gib, 0.0) for m in new)
            regrown = max((m.activation_gib for m in new), default=0.0)
            if static_gib + activation_gib - freed + regrown > limit_gib:
                continue
            cost = sum(m.forward_ms for m in new)
            if best is None or cost < best[0]:
                best = (cost, (v, n))
    return None if best is None else best[1]
