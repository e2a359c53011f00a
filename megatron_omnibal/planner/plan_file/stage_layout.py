"""One pipeline stage's slice of the VLM: the one type plan.json's stages and the training
stages share.

Why its own module on the pure side: the plan file (planner.plan.StagePlan adds its predicted
times and memory to it) and the Megatron side (the stage a rank builds, the layout stored in a
checkpoint) describe a stage with the same eight fields; defining them once means no field can
drift and nothing is converted field by field. Pure Python: no torch, no Megatron.

Model order is [patch embedding, ViT layers, projector, LLM embedding, LLM layers, head]. Layer
ranges are half-open and use GLOBAL layer numbering per tower.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage's slice of the VLM (half-open global layer ranges per tower); the
    stages of a run are checked together (megatron.layout.validate_layout)."""

    vit_layers: tuple[int, int]
    llm_layers: tuple[int, int]
    patch_embed: bool
    projector: bool
    llm_embed: bool
    head: bool
    vit_recompute: int = 0
    llm_recompute: int = 0

    @property
    def num_vit_layers(self) -> int:
        return self.vit_layers[1] - self.vit_layers[0]

    @property
    def num_llm_layers(self) -> int:
        return self.llm_layers[1] - self.llm_layers[0]

    @property
    def has_vision(self) -> bool:
        """Whether this stage sees the ViT hidden states (input or produced)."""
        return self.patch_embed or self.num_vit_layers > 0 or self.projector

    @property
    def layout(self) -> StageLayout:
        """The stage's layout alone (a plan's stage without its predictions)."""
        if type(self) is StageLayout:
            return self
        return StageLayout(**{f.name: getattr(self, f.name) for f in fields(StageLayout)})

    def to_dict(self) -> dict[str, Any]:
        """The layout's fields as JSON-ready data (a checkpoint's record of its stages)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(StageLayout)}
        out["vit_layers"] = list(self.vit_layers)
        out["llm_layers"] = list(self.llm_layers)
        return out
