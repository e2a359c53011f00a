"""OpenGVLab InternVL-Chat's data side, from its config.json: min/max_dynamic_patch,
use_thumbnail, dynamic_image_size, force_image_size and `template` (InternVL's image style and
template otherwise)."""

from __future__ import annotations

from megatron_omnibal.data.images.tiling import TilingConfig
from megatron_omnibal.data.text import conversations as conv
from megatron_omnibal.models.families.family import DataDefaults
from megatron_omnibal.models.families.shared.hf_files import HFFiles
from megatron_omnibal.models.families.shared.internvit import TEMPLATE, default_data
from megatron_omnibal.models.spec import ModelSpec


def data_defaults(spec: ModelSpec, files: HFFiles | None) -> DataDefaults:
    if files is None:
        return default_data(spec)
    cfg = files.config
    tile = int(cfg.get("force_image_size") or spec.vit.image_size)
    dynamic = bool(cfg.get("dynamic_image_size", True))
    tiling = TilingConfig(mode="dynamic", tile=tile, tokens_per_tile=spec.tokens_per_tile,
                          min_tiles=int(cfg.get("min_dynamic_patch", 1)) if dynamic else 1,
                          max_tiles=int(cfg.get("max_dynamic_patch", 12)) if dynamic else 1,
                          thumbnail=bool(cfg.get("use_thumbnail", True)))
    named = cfg.get("template")
    if named is not None and named not in conv.TEMPLATES:
        return DataDefaults(tiling=tiling, template=None,
                            template_note=f"{files.path}/config.json names template {named!r}, "
                            "which is not built in")
    return DataDefaults(tiling=tiling, template=TEMPLATE)
