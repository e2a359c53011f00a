"""The data side of a model: how its images are tiled, its chat template, its image tokens.

`omnibal stats --model NAME|FILE|HF_DIR` counts a dataset the way that model's training loader
sees it. Tile size, tokens per tile and the image token ids come from the ModelSpec; the rest
from the model's family (its `data_defaults` hook, models/families/<family>/data.py: InternVL's
dynamic tiles with a thumbnail and `<img>` + `<IMG_CONTEXT>` x n + `</img>`, LLaVA's padded tile
or AnyRes grid and `<image>` x n, Qwen2.5-VL's native resolution and videos) and, for a Hugging
Face checkpoint directory, from its own files (processor configs, chat template, tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_omnibal.data.images.tiling import TilingConfig
from megatron_omnibal.data.native.video import NativeVideoSettings
from megatron_omnibal.data.text import conversations as conv
from megatron_omnibal.models.families.registry import BY_DATA_TYPE, family_for_data, family_of_spec
from megatron_omnibal.models.families.shared.hf_files import read_hf_files


@dataclass(frozen=True, kw_only=True)
class ModelDataSide:
    """The model's defaults for `omnibal stats` (flags may override tiling and template)."""

    family: str  # the model family whose data side this is (models.families.registry)
    tiling: TilingConfig
    template: str | None  # None: the checkpoint names a template that is not built in
    template_note: str  # why there is no template, for the error message
    image_style: conv.ImageStyle
    tokenizer: str | None  # the checkpoint directory, when it holds a tokenizer
    dummy_tile: bool = True  # a text-only sample runs one blank tile (not Qwen2.5-VL)
    native_video: NativeVideoSettings = NativeVideoSettings()  # Qwen2.5-VL's videos


def model_data_side(spec: Any, hf_dir: str | Path | None = None) -> ModelDataSide:
    """The data side of `spec` (a ModelSpec), read from `hf_dir` where it is a checkpoint."""
    files = read_hf_files(Path(hf_dir)) if hf_dir is not None else None
    if files is None:
        family = family_of_spec(spec)
    else:
        family = family_for_data(files.model_type)
        if family is None:
            raise ValueError(f"{hf_dir}: model_type {files.model_type!r} is not one this tool "
                             f"counts ({', '.join(BY_DATA_TYPE)})")
    defaults = family.data_defaults(spec, files)
    size = spec.vit.image_size
    if defaults.tiling.tile != size:
        raise ValueError(f"{hf_dir}: images are tiled at {defaults.tiling.tile} pixels, the "
                         f"model's vision encoder takes {size}")
    tokenizer = str(hf_dir) if files and files.has_tokenizer else None
    return ModelDataSide(family=family.name, tiling=defaults.tiling, template=defaults.template,
                         template_note=defaults.template_note, image_style=family.image_style,
                         tokenizer=tokenizer, dummy_tile=family.dummy_tile,
                         native_video=defaults.native_video)
