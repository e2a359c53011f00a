"""The `Family` interface: the named hooks every model family provides, which the rest of the
package calls through the registry instead of branching on family names.

Why a frozen dataclass of functions: a family is data (a name, a tower kind, an image style)
plus a few functions of a checkpoint or a spec; one value per family keeps them in one place and
lets the registry list, look up and check them. Nothing here imports torch: the planner reads
the registry, and the hooks that convert tensors import torch when they run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_omnibal.data.images.tiling import TilingConfig
from megatron_omnibal.data.native.video import NativeVideoSettings
from megatron_omnibal.data.text.conversations import ImageStyle
from megatron_omnibal.models.families.shared.config import HFModel
from megatron_omnibal.models.families.shared.hf_files import HFFiles
from megatron_omnibal.models.families.shared.weights import (
    Rule,
    per_expert_rules,
    tiled_patch_shapes,
)
from megatron_omnibal.models.spec import ModelSpec, VisionSpec

if TYPE_CHECKING:
    import torch

KeyStyle = tuple[tuple[str, str], ...]  # (file prefix, rule prefix), applied in order
TOWERS = ("tiled", "native")  # the vision towers megatron/stages/families.py builds


@dataclass(frozen=True, kw_only=True)
class DataDefaults:
    """A family's data side for one model: how images (and videos) are cut, the chat template."""

    tiling: TilingConfig
    template: str | None  # None: the checkpoint names a template that is not built in
    template_note: str = ""  # why there is no template, for the error message
    native_video: NativeVideoSettings = NativeVideoSettings()  # native towers' videos


@dataclass(frozen=True, kw_only=True)
class VitAttention:
    """What a ViT layer's attention costs the planner: the tokens each token attends to in a
    windowed layer and in a full one (averaged), and how many layers attend fully."""

    window_span: float
    full_span: float
    full_layers: int


def tiled_attention(v: VisionSpec, image_tiles: np.ndarray | None) -> VitAttention:
    """A tiled tower: every token of a tile attends to every token of its tile, in every layer."""
    return VitAttention(window_span=v.seq_per_tile, full_span=v.seq_per_tile, full_layers=0)


def _no_unused(model: HFModel, name: str) -> bool:
    return False


def _no_key_style(names: set[str], transformers_4: bool) -> KeyStyle:
    return ()


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family. Hooks by concern:

    - config: `name` is config.json's `model_type` that `read_config(path, config)` reads into
      an HFModel; `claims(spec)` says a spec with no checkpoint (a preset, a spec file) is this
      family's (the registry takes the first family in its order that claims it);
    - weights: `vision_rules` and `projector_rules` (HF <-> canonical tensors; the LLM's rules
      are shared but for a mixture-of-experts layer's `expert_rules(i, model)`: one tensor per
      expert by default, fused tensors for Qwen3-VL-MoE), `patch_shapes` (canonical shapes of
      the patch embedding), `unused` (HF
      tensors the model never uses), `key_style` (prefixes this family's files add to or take
      from the rules' names: transformers_4 says the file uses transformers 4.5x's
      `model.language_model.*`);
    - data: `data_defaults(spec, files)` (tiling, template, videos; `files` is None without a
      checkpoint directory), `image_style`, `dummy_tile`, `data_model_types` (other
      model_types whose data side this family counts, e.g. llava_next);
    - oracle: `reference(model, hf, samples)`, transformers' forward of probe samples (of the
      model itself, or of its transformers-format twin where `transformers_class` is False:
      a family that runs only with its own remote code);
    - planner: `vit_attention(vit, image_tiles)`;
    - stages: `tower`, the key of megatron/stages/families.py's torch hooks (patch embedding,
      ViT block, attention inputs).

    The defaults are a tiled tower's (InternViT, CLIP): a 2-D patch convolution and a position
    table, attention within each tile.
    """

    name: str
    summary: str
    read_config: Callable[[Path, dict], HFModel]
    claims: Callable[[ModelSpec], bool]
    vision_rules: Callable[[HFModel], list[Rule]]
    projector_rules: Callable[[HFModel], list[Rule]]
    data_defaults: Callable[[ModelSpec, HFFiles | None], DataDefaults]
    image_style: ImageStyle
    reference: Callable[[torch.nn.Module, HFModel, Sequence[Any]], dict[str, torch.Tensor]]
    transformers_class: bool = True  # transformers builds it (else only its own remote code)
    tower: str = "tiled"
    patch_shapes: Callable[[VisionSpec], dict[str, tuple[int, ...]]] = tiled_patch_shapes
    vit_attention: Callable[[VisionSpec, np.ndarray | None], VitAttention] = tiled_attention
    unused: Callable[[HFModel, str], bool] = _no_unused
    key_style: Callable[[set[str], bool], KeyStyle] = _no_key_style
    expert_rules: Callable[[int, HFModel], list[Rule]] = per_expert_rules
    dummy_tile: bool = True  # a text-only sample runs one blank tile
    data_model_types: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.tower not in TOWERS:
            raise ValueError(f"family {self.name}: tower {self.tower!r} is not one of {TOWERS}")
