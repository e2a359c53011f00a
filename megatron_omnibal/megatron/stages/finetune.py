"""Fine-tuning as InternVL and LLaVA users do it: freeze some of [ViT, projector, LLM] and/or
train the ViT with a smaller learning rate.

Why here: freezing must happen where the stage is built (a parameter without requires_grad gets
no gradient buffer in Megatron's DDP and no optimizer state), and the ViT's learning rate is a
parameter-group override of megatron-core's optimizer, which megatron.training builds from its
own flags; this module adds both without touching either.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: megatron/flags/args.py imports this module without torch
    import torch

PARTS = ("vit", "projector", "llm")
# Which stage submodules make up each part (models.spec order: ViT, projector, LLM); Qwen3-VL's
# DeepStack mergers bridge the towers as the projector does and go with it.
PART_MODULES = {
    "vit": ("patch_embed", "vit", "vit_final_norm"),
    "projector": ("projector", "deepstack_mergers"),
    "llm": ("embedding", "llm", "output_layer"),
}
VIT_PARAM = "omnibal_vit"  # attribute marking ViT parameters for the learning-rate override


@dataclass(frozen=True, kw_only=True)
class FinetuneSettings:
    """Frozen parts and the ViT's learning-rate multiplier (validated)."""

    freeze: frozenset[str] = frozenset()
    vit_lr_mult: float = 1.0

    def __post_init__(self) -> None:
        unknown = sorted(self.freeze - set(PARTS))
        if unknown:
            raise ValueError(
                f"--omnibal-freeze: unknown part(s) {', '.join(unknown)} (choose from "
                f"{', '.join(PARTS)})"
            )
        if not self.vit_lr_mult > 0:
            raise ValueError(f"--omnibal-vit-lr-mult must be > 0, got {self.vit_lr_mult}")
        if "vit" in self.freeze and self.vit_lr_mult != 1.0:
            raise ValueError("--omnibal-vit-lr-mult has no effect with --omnibal-freeze vit")


def apply_to_stage(stage: torch.nn.Module, settings: FinetuneSettings) -> None:
    """Freeze the stage's parameters of frozen parts; mark its ViT parameters."""
    for part, names in PART_MODULES.items():
        for name in names:
            module = getattr(stage, name, None)
            if module is None:
                continue
            for p in module.parameters():
                if part in settings.freeze:
                    p.requires_grad_(False)
                if part == "vit":
                    setattr(p, VIT_PARAM, True)


def install_vit_lr_override(mult: float) -> None:
    """Make megatron.training's optimizer give ViT parameters `mult` x the learning rate (max
    and min) through megatron-core's parameter-group overrides."""
    if mult == 1.0:
        return
    from megatron.core.optimizer import ParamKey
    from megatron.training import training

    build = training.get_megatron_optimizer_config
    if getattr(build, "__omnibal__", False):
        return

    def with_vit_override(args: argparse.Namespace) -> Any:
        config, overrides = build(args)
        overrides = dict(overrides or {})
        overrides[ParamKey(attr=VIT_PARAM)] = {
            "max_lr": config.lr * mult,
            "min_lr": config.min_lr * mult,
        }
        return config, overrides

    with_vit_override.__omnibal__ = True  # type: ignore[attr-defined]
    training.get_megatron_optimizer_config = with_vit_override
