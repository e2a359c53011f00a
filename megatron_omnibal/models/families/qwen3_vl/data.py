"""Qwen3-VL's data side: native-resolution images as its released processor resizes them
(transformers' Qwen2VLImageProcessor with 16 px patches: `smart_resize` to multiples of the
32 px merge group, between `size.shortest_edge` and `size.longest_edge` pixels, mean and std
0.5), `<|vision_start|>` + `<|image_pad|>` x n + `<|vision_end|>`, the checkpoint's own chat
template ("hf") when it ships one, else the built-in qwen2_vl (ChatML, the layout of Qwen3-VL's
own template for a plain conversation); no blank tile for text-only samples.

Videos by Qwen3-VL's own rule (data/native/qwen3_video.py): its video_preprocessor_config.json
(fps, min/max frames, `size` pixel limits over the whole video, cap_pixels_per_frame,
max_video_tokens), each temporal patch one grid after its timestamp text.

Where the checkpoint has no preprocessor_config.json (or for a preset) the released one applies
(Qwen/Qwen3-VL-*-Instruct: 65,536 to 16,777,216 pixels; videos 4,096 to 25,165,824 pixels in
all, 2 frames/s, 4 to 768 frames); the file's entries win.
"""

from __future__ import annotations

from typing import Any

from megatron_omnibal.data.native.video import NativeVideoSettings
from megatron_omnibal.models.families.family import DataDefaults
from megatron_omnibal.models.families.shared.hf_files import HFFiles, colour
from megatron_omnibal.models.families.shared.qwen_native_data import native_tiling
from megatron_omnibal.models.spec import ModelSpec, VisionSpec

# Qwen/Qwen3-VL-*-Instruct's preprocessor_config.json (the image processor's entries).
# Its patch and merge sizes are the model's own unless the checkpoint's file says otherwise.
RELEASED_PREPROCESSOR: dict[str, Any] = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}  # fmt: skip


# Qwen/Qwen3-VL-*-Instruct's video_preprocessor_config.json over Qwen3VLVideoProcessor's own
# defaults (fps 2, 4 to 768 frames, 768 merge groups a frame when capped).
RELEASED_VIDEO: dict[str, Any] = {
    "size": {"shortest_edge": 4096, "longest_edge": 25165824}, "fps": 2, "min_frames": 4,
    "max_frames": 768, "max_video_tokens": 768, "cap_pixels_per_frame": False,
}  # fmt: skip


def video_settings(pre: dict[str, Any], v: VisionSpec, where: object) -> NativeVideoSettings:
    """Qwen3-VL's video rule from its video_preprocessor_config.json entries (over the
    released ones; its patch, merge and temporal sizes, where it has none, the tower `v`'s):
    its `size` limits hold for the whole video (data/native/qwen3_video.py)."""
    path = f"{where}/video_preprocessor_config.json"
    tile, temporal = v.image_size, v.temporal_patch_size
    pre = {**RELEASED_VIDEO, "patch_size": v.patch_size, "merge_size": v.spatial_merge_size,
           "temporal_patch_size": temporal, **pre}  # fmt: skip
    factor = int(pre["patch_size"]) * int(pre["merge_size"])
    if factor != tile or int(pre["temporal_patch_size"]) != temporal:
        raise ValueError(f"{path}: patch_size x merge_size = {factor} px and temporal_patch_"
                         f"size {pre['temporal_patch_size']}, the model's are {tile} px and "
                         f"{temporal}")
    size = pre["size"] if isinstance(pre["size"], dict) else {}
    colours = {key: colour(pre, key, None, path) for key in ("image_mean", "image_std")
               if key in pre}
    try:
        return NativeVideoSettings(
            rule="qwen3_vl", fps=pre["fps"], min_frames=pre["min_frames"],
            max_frames=pre["max_frames"], min_pixels=size.get("shortest_edge"),
            max_pixels=size.get("longest_edge"), max_video_tokens=pre["max_video_tokens"],
            cap_pixels_per_frame=bool(pre["cap_pixels_per_frame"]),
            temporal_patch_size=temporal, **colours)  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def preprocessor(spec: ModelSpec, files: HFFiles | None) -> dict[str, Any]:
    """The checkpoint's image processor entries over the released ones (its patch and merge
    sizes, where it has none, the model's)."""
    v = spec.vit
    model = {"patch_size": v.patch_size, "merge_size": v.spatial_merge_size}
    return {**RELEASED_PREPROCESSOR, **model, **(files.preprocessor if files else {})}


def data_defaults(spec: ModelSpec, files: HFFiles | None) -> DataDefaults:
    where = files.path if files else None
    tiling = native_tiling(preprocessor(spec, files), spec.vit.image_size, spec.tokens_per_tile,
                           where)
    video = video_settings(files.video if files else {}, spec.vit, where)
    template = "hf" if files and files.chat_template else "qwen2_vl"
    return DataDefaults(tiling=tiling, template=template, native_video=video)
