"""transformers' `llava` config.json (LlavaForConditionalGeneration, a CLIP tower) -> its
ModelSpec; the tower's layers past `vision_feature_layer` are not built."""

from __future__ import annotations

from pathlib import Path

from megatron_omnibal.models.families.shared.config import (
    HFModel,
    checked_towers,
    feature_layers,
    language,
    text_arch,
    vision_act,
    with_tie,
)
from megatron_omnibal.models.spec import ModelSpec, ProjectorSpec, VisionSpec


def read_config(path: Path, doc: dict) -> HFModel:
    cfg, vc, tc = checked_towers(
        path, "vision", "clip_vision_model", "only CLIP vision towers are supported"
    )
    arch = text_arch(tc.model_type, path)
    total = int(vc.num_hidden_layers)
    used = feature_layers(cfg.vision_feature_layer, total, path, "vision_feature_layer")
    vit = VisionSpec(
        num_layers=used,
        hidden_size=int(vc.hidden_size),
        ffn_hidden_size=int(vc.intermediate_size),
        num_attention_heads=int(vc.num_attention_heads),
        image_size=int(vc.image_size),
        patch_size=int(vc.patch_size),
        norm="layernorm",
        norm_eps=float(vc.layer_norm_eps),
        activation=vision_act(vc.hidden_act, path),
        qkv_bias=True,
        patch_bias=False,
        pre_norm=True,
        drop_class_token=cfg.vision_feature_select_strategy == "default",
    )
    spec = ModelSpec(
        name=path.name,
        vit=vit,
        projector=ProjectorSpec(
            type="mlp",
            downsample=1.0,
            activation=vision_act(cfg.projector_hidden_act, path),
            bias=bool(cfg.multimodal_projector_bias),
        ),
        llm=with_tie(language(tc, arch, path), cfg.tie_word_embeddings),
        image_token_id=int(cfg.image_token_id),
        source=str(path),
    )
    return HFModel(path, spec, "llava", arch, total)
