"""The recompute that would let a stage fit: the planner's memory model of the stage, scaled to
what the preflight measured on it.

Why scaled: the planner's activation figures are modeled (flash attention, BF16); the measured
peak on this stage is the truth for the current recompute. The ratio of the two carries over to
other recompute counts of the same stage on the same micro-batch, since recomputing a layer swaps
its modeled activations for its modeled checkpoint. Pure numpy: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.costs import GROUP_LLM, GROUP_VIT, analytic_costs, workload_features
from megatron_omnibal.planner.hardware import Hardware
from megatron_omnibal.planner.memory import stage_memory_mib, stage_time_ms


@dataclass(frozen=True, kw_only=True)
class StageUnits:
    """A stage's layers: ViT [vit_first, vit_end), the projector or not, LLM [llm_first,
    llm_end), with its current recompute counts."""

    vit_first: int
    vit_end: int
    projector: bool
    llm_first: int
    llm_end: int
    vit_recompute: int
    llm_recompute: int

    def unit_range(self, vit_layers: int) -> tuple[int, int]:
        """[lo, hi) over the planner's units [ViT layers, projector, LLM layers]."""
        starts = []
        ends = []
        if self.vit_end > self.vit_first:
            starts.append(self.vit_first)
            ends.append(self.vit_end)
        if self.projector:
            starts.append(vit_layers)
            ends.append(vit_layers + 1)
        if self.llm_end > self.llm_first:
            starts.append(vit_layers + 1 + self.llm_first)
            ends.append(vit_layers + 1 + self.llm_end)
        if not starts:
            raise ValueError("a stage without layers has no recompute to choose")
        return min(starts), max(ends)


def fitting_recompute(
    *,
    spec: ModelSpec,
    hardware: Hardware,
    tp: int,
    stage: StageUnits,
    tiles: int,
    tokens: int,
    sumsq: int,
    static_gib: float,
    activation_gib: float,
    limit_gib: float,
) -> tuple[int, int] | None:
    """(ViT, LLM) layers to recompute on this stage so that its measured static state plus its
    scaled activations stay within `limit_gib`, the cheapest such choice in recompute time; None
    when even recomputing every layer does not fit."""
    costs = analytic_costs(spec, hardware, tp=tp).at(workload_features(tiles, tokens, sumsq))
    lo, hi = stage.unit_range(spec.vit.num_layers)

    def stored_mib(v: int, llm: int) -> float:
        counts = {GROUP_VIT: v, GROUP_LLM: llm}
        return (stage_memory_mib(costs, lo, hi, counts, 1)
                - stage_memory_mib(costs, lo, hi, counts, 0))  # fmt: skip

    now = stored_mib(stage.vit_recompute, stage.llm_recompute)
    if now <= 0:
        return None
    # measured GiB per modeled MiB of one micro-batch: it holds the in-flight count as well
    scale = activation_gib / now
    best: tuple[float, tuple[int, int]] | None = None
    for v in range(stage.vit_end - stage.vit_first + 1):
        for llm in range(stage.llm_end - stage.llm_first + 1):
            if static_gib + scale * stored_mib(v, llm) > limit_gib:
                continue
            _, backward = stage_time_ms(costs, lo, hi, {GROUP_VIT: v, GROUP_LLM: llm})
            if best is None or backward < best[0]:
                best = (backward, (v, llm))
    return None if best is None else best[1]
