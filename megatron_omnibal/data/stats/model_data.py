"""The data side of a model: how its images are tiled, its chat template, its image tokens.

`omnibal stats --model NAME|FILE|HF_DIR` counts a dataset the way that model's training loader
sees it. Tile size, tokens per tile and the image token ids come from the ModelSpec; the rest
from the family (InternVL: dynamic tiles with a thumbnail, `<img>` + `<IMG_CONTEXT>` x n +
`</img>`, the internvl2_5 template; LLaVA: one padded tile, `<image>` x n, vicuna_v1) and, for a
Hugging Face checkpoint directory, from its own files:

- OpenGVLab `internvl_chat` config.json: min/max_dynamic_patch, use_thumbnail,
  dynamic_image_size, force_image_size and `template`;
- transformers `internvl`: preprocessor_config.json (GotOcr2 image processor) min_patches,
  max_patches, size. InternVLProcessor crops to patches whatever the image processor's own
  `crop_to_patches` says (its call default), so tiles are always dynamic here;
- transformers `llava` / `llava_next`: preprocessor_config.json crop_size; llava_next's
  config.json image_grid_pinpoints (AnyRes); the checkpoint's own chat template ("hf") when it
  ships one (a LLaVA on Llama-3.x is not trained with Vicuna's), else vicuna_v1;
- transformers `qwen2_5_vl`: native-resolution tiling (one 28 px merge group per tile, one
  token each) between preprocessor_config.json's min_pixels and max_pixels (or its `size`
  shortest_edge / longest_edge, the newer spelling; min/max_pixels win, as in transformers),
  whose patch_size x merge_size must be the model's 28 px, and its image_mean / image_std (the
  OpenAI CLIP ones when absent); `<|vision_start|>` +
  `<|image_pad|>` x n + `<|vision_end|>`; the checkpoint's own chat template ("hf") when it
  ships one, else the built-in qwen2_vl (ChatML); no blank tile for text-only samples (the
  model runs none). Without a checkpoint directory the released processor's limits apply
  (3,136 to 12,845,056 pixels). Videos follow qwen-vl-utils' rule (data/native/video.py) with
  the settings of video_preprocessor_config.json where the checkpoint has one (fps,
  min_frames, max_frames, min/max_pixels or `size`, max_video_tokens, image_mean/std; its
  patch_size x merge_size and temporal_patch_size must be the model's), else qwen-vl-utils'
  defaults; `<|vision_start|>` + `<|video_pad|>` x n + `<|vision_end|>`;
- the tokenizer in the directory (unless another is given).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_omnibal.data.images.tiles import CLIP_MEAN, CLIP_STD
from megatron_omnibal.data.images.tiling import (
    DEFAULT_PINPOINTS,
    QWEN_MAX_PIXELS,
    QWEN_MIN_PIXELS,
    TilingConfig,
)
from megatron_omnibal.data.native.video import NativeVideoSettings
from megatron_omnibal.data.text import conversations as conv

FAMILIES = {"internvl_chat": "internvl", "internvl": "internvl", "llava": "llava",
            "llava_next": "llava", "qwen2_5_vl": "qwen2_5_vl"}
STYLES = {"internvl": conv.INTERNVL_IMAGE, "llava": conv.LLAVA_IMAGE,
          "qwen2_5_vl": conv.QWEN_VL_IMAGE}
DEFAULT_TEMPLATES = {"internvl": "internvl2_5", "llava": "vicuna_v1", "qwen2_5_vl": "qwen2_vl"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


@dataclass(frozen=True, kw_only=True)
class ModelDataSide:
    """The model's defaults for `omnibal stats` (flags may override tiling and template)."""

    family: str  # internvl | llava | qwen2_5_vl
    tiling: TilingConfig
    template: str | None  # None: the checkpoint names a template that is not built in
    template_note: str  # why there is no template, for the error message
    image_style: conv.ImageStyle
    tokenizer: str | None  # the checkpoint directory, when it holds a tokenizer
    dummy_tile: bool = True  # a text-only sample runs one blank tile (not Qwen2.5-VL)
    native_video: NativeVideoSettings = NativeVideoSettings()  # Qwen2.5-VL's videos


def model_data_side(spec: Any, hf_dir: str | Path | None = None) -> ModelDataSide:
    """The data side of `spec` (a ModelSpec), read from `hf_dir` where it is a checkpoint."""
    hf = _read_hf(Path(hf_dir)) if hf_dir is not None else None
    kind = hf["config"].get("model_type") if hf else None
    if hf is not None and kind not in FAMILIES:
        raise ValueError(f"{hf_dir}: model_type {kind!r} is not one this tool counts "
                         f"({', '.join(FAMILIES)})")
    family = FAMILIES[kind] if kind else _family_of(spec)
    size, tpt = spec.vit.image_size, spec.tokens_per_tile
    grid = spec.vit.image_size // spec.vit.patch_size
    template, note = DEFAULT_TEMPLATES[family], ""
    video = NativeVideoSettings()
    if family == "qwen2_5_vl":
        tiling = _native_tiling(hf["preprocessor"] if hf else {}, size, tpt, hf_dir)
        video = _native_video(hf["video"] if hf else {}, size, spec.vit.temporal_patch_size,
                              hf_dir)
        if hf and hf["chat_template"]:
            template = "hf"
    elif kind == "internvl_chat":
        cfg = hf["config"]
        tile = int(cfg.get("force_image_size") or size)
        dynamic = bool(cfg.get("dynamic_image_size", True))
        tiling = TilingConfig(mode="dynamic", tile=tile, tokens_per_tile=tpt,
                              min_tiles=int(cfg.get("min_dynamic_patch", 1)) if dynamic else 1,
                              max_tiles=int(cfg.get("max_dynamic_patch", 12)) if dynamic else 1,
                              thumbnail=bool(cfg.get("use_thumbnail", True)))
        named = cfg.get("template")
        if named is not None and named not in conv.TEMPLATES:
            template, note = None, (f"{hf_dir}/config.json names template {named!r}, which "
                                    "is not built in")
    elif kind == "internvl":
        pre = hf["preprocessor"]
        tiling = TilingConfig(mode="dynamic", tile=_side(pre.get("size"), size),
                              tokens_per_tile=tpt, min_tiles=int(pre.get("min_patches", 1)),
                              max_tiles=int(pre.get("max_patches", 12)), thumbnail=True)
    elif kind in ("llava", "llava_next"):
        tile = _side(hf["preprocessor"].get("crop_size"), size)
        if kind == "llava_next":
            points = hf["config"].get("image_grid_pinpoints") or DEFAULT_PINPOINTS
            tiling = TilingConfig(mode="anyres", tile=tile, tokens_per_tile=tpt,
                                  max_tiles=1, features_per_side=grid,
                                  pinpoints=tuple((int(h), int(w)) for h, w in points))
        else:
            tiling = TilingConfig(mode="fixed", tile=tile, tokens_per_tile=tpt, max_tiles=1)
        if hf["chat_template"]:
            template = "hf"
    elif family == "internvl":
        tiling = TilingConfig(mode="dynamic", tile=size, tokens_per_tile=tpt)
    else:
        tiling = TilingConfig(mode="fixed", tile=size, tokens_per_tile=tpt, max_tiles=1,
                              features_per_side=grid)
    if tiling.tile != size:
        raise ValueError(f"{hf_dir}: images are tiled at {tiling.tile} pixels, the model's "
                         f"vision encoder takes {size}")
    tokenizer = str(hf_dir) if hf and hf["has_tokenizer"] else None
    return ModelDataSide(family=family, tiling=tiling, template=template, template_note=note,
                         image_style=STYLES[family], tokenizer=tokenizer,
                         dummy_tile=family != "qwen2_5_vl", native_video=video)


def _family_of(spec: Any) -> str:
    if spec.vit.native_resolution:
        return "qwen2_5_vl"
    return "internvl" if spec.projector.type == "pixel_shuffle_mlp" else "llava"


def _native_tiling(pre: dict[str, Any], tile: int, tokens_per_tile: int,
                   hf_dir: str | Path | None) -> TilingConfig:
    """Qwen2.5-VL's resize limits from its preprocessor_config.json (released defaults when
    there is none); its patch x merge size must be the model's tile."""
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    low = pre.get("min_pixels", size.get("shortest_edge", QWEN_MIN_PIXELS))
    high = pre.get("max_pixels", size.get("longest_edge", QWEN_MAX_PIXELS))
    factor = int(pre.get("patch_size", 14)) * int(pre.get("merge_size", 2))
    if pre and factor != tile:
        raise ValueError(f"{hf_dir}/preprocessor_config.json: patch_size x merge_size = "
                         f"{factor} px, the model's merge group is {tile} px")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high)):
        raise ValueError(f"{hf_dir}/preprocessor_config.json: min/max pixels {low!r}, {high!r} "
                         "are not integers")
    mean, std = (_colour(pre, key, default, f"{hf_dir}/preprocessor_config.json")
                 for key, default in
                 (("image_mean", CLIP_MEAN), ("image_std", CLIP_STD)))
    return TilingConfig(mode="native", tile=tile, tokens_per_tile=tokens_per_tile, max_tiles=1,
                        min_pixels=low, max_pixels=high, image_mean=mean, image_std=std)


def _native_video(pre: dict[str, Any], tile: int, temporal: int,
                  hf_dir: str | Path | None) -> NativeVideoSettings:
    """Qwen2.5-VL's video settings from its video_preprocessor_config.json (qwen-vl-utils'
    defaults where it has none); its patch x merge size and temporal patch must be the
    model's."""
    where = f"{hf_dir}/video_preprocessor_config.json"
    factor = int(pre.get("patch_size", 14)) * int(pre.get("merge_size", 2))
    if factor != tile or int(pre.get("temporal_patch_size", temporal)) != temporal:
        raise ValueError(f"{where}: patch_size x merge_size = {factor} px and temporal_patch_"
                         f"size {pre.get('temporal_patch_size')}, the model's are {tile} px "
                         f"and {temporal}")
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    base = NativeVideoSettings()
    values = {
        "fps": pre.get("fps") or base.fps,
        "min_frames": pre.get("min_frames", base.min_frames),
        "max_frames": pre.get("max_frames", base.max_frames),
        "min_pixels": pre.get("min_pixels", size.get("shortest_edge", base.min_pixels)),
        "max_pixels": pre.get("max_pixels", size.get("longest_edge", base.max_pixels)),
        "max_video_tokens": pre.get("max_video_tokens", base.max_video_tokens),
        "temporal_patch_size": temporal,
    }
    colours = {key: _colour(pre, key, None, where) for key in ("image_mean", "image_std")
               if key in pre}
    try:
        return NativeVideoSettings(**values, **colours)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _colour(pre: dict[str, Any], key: str, default: tuple[float, float, float] | None,
            where: str) -> tuple[float, float, float]:
    """A processor's per-channel mean or std (its default when the file `where` has none)."""
    value = pre.get(key, default)
    if not (isinstance(value, list | tuple) and len(value) == 3 and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value)):
        raise ValueError(f"{where}: {key} {value!r} is not three numbers (R, G, B)")
    return tuple(float(v) for v in value)


def _read_hf(path: Path) -> dict[str, Any]:
    config = _json(path / "config.json", required=True)
    tokenizer_config = _json(path / "tokenizer_config.json")
    return {"config": config, "preprocessor": _json(path / "preprocessor_config.json"),
            "video": _json(path / "video_preprocessor_config.json"),
            "has_tokenizer": any((path / f).is_file() for f in TOKENIZER_FILES),
            "chat_template": bool(tokenizer_config.get("chat_template"))
            or any((path / f).is_file() for f in CHAT_TEMPLATE_FILES)}


def _json(path: Path, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ValueError(f"{path.parent}: no config.json (not a Hugging Face checkpoint)")
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot parse ({exc})") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return doc


def _side(value: Any, default: int) -> int:
    """A square tile side from an image processor's size / crop_size entry."""
    if value is None:
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        sides = {value.get("height"), value.get("width")} - {None}
        if len(sides) == 1:
            return int(sides.pop())
        if "shortest_edge" in value:
            return int(value["shortest_edge"])
    raise ValueError(f"image size {value!r}: expected square tiles")
