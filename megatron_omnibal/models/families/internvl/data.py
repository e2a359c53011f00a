"""transformers InternVL's data side: dynamic tiles with a thumbnail from preprocessor_config.json
(GotOcr2 image processor: min_patches, max_patches, size; InternVLProcessor crops to patches
whatever the image processor's own `crop_to_patches` says, so tiles are always dynamic here),
the internvl2_5 template, `<img>` + `<IMG_CONTEXT>` x n + `</img>`."""

from __future__ import annotations

from megatron_omnibal.data.images.tiling import TilingConfig
from megatron_omnibal.models.families.family import DataDefaults
from megatron_omnibal.models.families.shared.hf_files import HFFiles, square_side
from megatron_omnibal.models.families.shared.internvit import TEMPLATE, default_data
from megatron_omnibal.models.spec import ModelSpec


def data_defaults(spec: ModelSpec, files: HFFiles | None) -> DataDefaults:
    if files is None:
        return default_data(spec)
    pre = files.preprocessor
    tile = square_side(pre.get("size"), spec.vit.image_size)
    tiling = TilingConfig(mode="dynamic", tile=tile, tokens_per_tile=spec.tokens_per_tile,
                          min_tiles=int(pre.get("min_patches", 1)),
                          max_tiles=int(pre.get("max_patches", 12)), thumbnail=True)
    return DataDefaults(tiling=tiling, template=TEMPLATE)
