"""Qwen3-VL's data side: native-resolution images as its released processor resizes them
(transformers' Qwen2VLImageProcessor with 16 px patches: `smart_resize` to multiples of the
32 px merge group, between `size.shortest_edge` and `size.longest_edge` pixels, mean and std
0.5), `<|vision_start|>` + `<|image_pad|>` x n + `<|vision_end|>`, the checkpoint's own chat
template ("hf") when it ships one, else the built-in qwen2_vl (ChatML, the layout of Qwen3-VL's
own template for a plain conversation); no blank tile for text-only samples.

Where the checkpoint has no preprocessor_config.json (or for a preset) the released one applies
(Qwen/Qwen3-VL-*-Instruct: 65,536 to 16,777,216 pixels); the file's entries win.
"""

from __future__ import annotations

from typing import Any

from megatron_omnibal.models.families.family import DataDefaults
from megatron_omnibal.models.families.shared.hf_files import HFFiles
from megatron_omnibal.models.families.shared.qwen_native_data import native_tiling
from megatron_omnibal.models.spec import ModelSpec

# Qwen/Qwen3-VL-*-Instruct's preprocessor_config.json (the image processor's entries).
RELEASED_PREPROCESSOR: dict[str, Any] = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}  # fmt: skip


def preprocessor(files: HFFiles | None) -> dict[str, Any]:
    """The checkpoint's image processor entries over the released ones."""
    return {**RELEASED_PREPROCESSOR, **(files.preprocessor if files else {})}


def data_defaults(spec: ModelSpec, files: HFFiles | None) -> DataDefaults:
    where = files.path if files else None
    tiling = native_tiling(preprocessor(files), spec.vit.image_size, spec.tokens_per_tile, where)
    template = "hf" if files and files.chat_template else "qwen2_vl"
    return DataDefaults(tiling=tiling, template=template)
