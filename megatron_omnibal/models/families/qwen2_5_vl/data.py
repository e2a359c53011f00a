"""Qwen2.5-VL's data side: native-resolution images and videos (shared/qwen_native_data.py),
`<|vision_start|>` + `<|image_pad|>` (or `<|video_pad|>`) x n + `<|vision_end|>`, the
checkpoint's own chat template ("hf") when it ships one, else the built-in qwen2_vl (ChatML);
no blank tile for text-only samples (the model runs none)."""

from __future__ import annotations

from megatron_omnibal.models.families.family import DataDefaults
from megatron_omnibal.models.families.shared.hf_files import HFFiles
from megatron_omnibal.models.families.shared.qwen_native_data import native_tiling, native_video
from megatron_omnibal.models.spec import ModelSpec


def data_defaults(spec: ModelSpec, files: HFFiles | None) -> DataDefaults:
    size = spec.vit.image_size
    where = files.path if files else None
    tiling = native_tiling(files.preprocessor if files else {}, size, spec.tokens_per_tile, where)
    video = native_video(files.video if files else {}, size, spec.vit.temporal_patch_size, where)
    template = "hf" if files and files.chat_template else "qwen2_vl"
    return DataDefaults(tiling=tiling, template=template, native_video=video)
