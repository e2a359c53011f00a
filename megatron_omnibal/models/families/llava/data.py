"""LLaVA's data side: one padded tile (preprocessor_config.json's crop_size), or LLaVA-NeXT's
AnyRes grid (config.json's image_grid_pinpoints); `<image>` x n; the checkpoint's own chat
template ("hf") when it ships one (a LLaVA on Llama-3.x is not trained with Vicuna's), else
vicuna_v1."""

from __future__ import annotations

from megatron_omnibal.data.images.tiling import DEFAULT_PINPOINTS, TilingConfig
from megatron_omnibal.models.families.family import DataDefaults
from megatron_omnibal.models.families.shared.hf_files import HFFiles, square_side
from megatron_omnibal.models.spec import ModelSpec


def data_defaults(spec: ModelSpec, files: HFFiles | None) -> DataDefaults:
    size, tpt = spec.vit.image_size, spec.tokens_per_tile
    grid = size // spec.vit.patch_size
    if files is None:
        return DataDefaults(template="vicuna_v1", tiling=TilingConfig(
            mode="fixed", tile=size, tokens_per_tile=tpt, max_tiles=1, features_per_side=grid))
    tile = square_side(files.preprocessor.get("crop_size"), size)
    if files.model_type == "llava_next":
        points = files.config.get("image_grid_pinpoints") or DEFAULT_PINPOINTS
        tiling = TilingConfig(mode="anyres", tile=tile, tokens_per_tile=tpt, max_tiles=1,
                              features_per_side=grid,
                              pinpoints=tuple((int(h), int(w)) for h, w in points))
    else:
        tiling = TilingConfig(mode="fixed", tile=tile, tokens_per_tile=tpt, max_tiles=1)
    return DataDefaults(tiling=tiling, template="hf" if files.chat_template else "vicuna_v1")
