"""transformers' `qwen2_5_vl` config.json (Qwen2_5_VLForConditionalGeneration) -> its ModelSpec:
the native-resolution tower, the patch merger and a Qwen2 LLM with M-RoPE; the hub's flat
config.json (text keys at the top level, `rope_scaling` of type mrope) and the re-saved one
(`text_config`) both, through transformers' own Qwen2_5_VLConfig."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megatron_omnibal.models.families.shared.config import (
    HFModel,
    checked_towers,
    language,
    mrope_section,
    need,
)
from megatron_omnibal.models.families.shared.qwen_native import native_tower
from megatron_omnibal.models.presets import QWEN25_MERGER, QWEN25_VIT
from megatron_omnibal.models.spec import ModelSpec


def read_config(path: Path, doc: dict) -> HFModel:
    cfg, vc, tc = checked_towers(path, "text", "qwen2_5_vl_text", "expected qwen2_5_vl_text")
    sides = {name: getattr(vc, name) for name in ("patch_size", "temporal_patch_size")}
    need(
        all(isinstance(v, int) for v in sides.values()),
        path,
        f"vision_config {sides}: only square patches of one size are supported",
    )
    need(
        int(vc.out_hidden_size) == int(tc.hidden_size),
        path,
        f"vision_config.out_hidden_size {vc.out_hidden_size} differs from the LLM's hidden "
        f"size {tc.hidden_size}",
    )
    need(vc.hidden_act == "silu", path, f"vision hidden_act {vc.hidden_act!r}: only silu")
    merge = int(vc.spatial_merge_size)
    # The architecture's fixed facts (norms, biases, SwiGLU, 2D RoPE) are the presets' tower.
    vit = native_tower(
        QWEN25_VIT,
        vc,
        window_size=int(vc.window_size),
        fullatt_block_indexes=tuple(int(i) for i in vc.fullatt_block_indexes),
        rope_theta=float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 1e4)),
        tokens_per_second=float(vc.tokens_per_second),
    )
    llm = language(tc, "qwen2", path)
    spec = ModelSpec(
        name=path.name,
        vit=vit,
        projector=replace(
            QWEN25_MERGER, downsample=1 / merge, hidden_size=int(vc.hidden_size) * merge**2
        ),
        llm=replace(
            llm,
            mrope_section=mrope_section(tc, path),
            tie_embeddings=bool(cfg.tie_word_embeddings),
        ),
        image_token_id=int(cfg.image_token_id),
        image_start_id=int(cfg.vision_start_token_id),
        image_end_id=int(cfg.vision_end_token_id),
        source=str(path),
    )
    return HFModel(path, spec, "qwen2_5_vl", "qwen2", int(vc.depth))
