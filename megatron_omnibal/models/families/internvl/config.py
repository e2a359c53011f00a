"""transformers' `internvl` config.json (InternVLForConditionalGeneration) -> its ModelSpec,
through transformers' own config classes (their defaults and renamed fields apply)."""

from __future__ import annotations

from pathlib import Path

from megatron_omnibal.models.families.shared.config import (
    HFModel,
    added_tokens,
    feature_layers,
    language,
    need,
    text_arch,
    transformers_config,
    vision_act,
    with_tie,
)
from megatron_omnibal.models.families.shared.internvit import INTERNVIT_NORMS
from megatron_omnibal.models.spec import ModelSpec, ProjectorSpec, VisionSpec


def read_config(path: Path, doc: dict) -> HFModel:
    cfg = transformers_config(path)
    vc, tc = cfg.vision_config, cfg.text_config
    arch = text_arch(tc.model_type, path)
    total = int(vc.num_hidden_layers)
    layer = cfg.vision_feature_layer
    used = feature_layers(layer, total, path, "vision_feature_layer")
    size = vc.image_size[0] if isinstance(vc.image_size, (list, tuple)) else vc.image_size
    patch = vc.patch_size[0] if isinstance(vc.patch_size, (list, tuple)) else vc.patch_size
    need(
        cfg.vision_feature_select_strategy == "default",
        path,
        "vision_feature_select_strategy must be 'default' (pixel shuffle drops the CLS token)",
    )
    vit = VisionSpec(
        num_layers=used,
        hidden_size=int(vc.hidden_size),
        ffn_hidden_size=int(vc.intermediate_size),
        num_attention_heads=int(vc.num_attention_heads),
        image_size=int(size),
        patch_size=int(patch),
        norm=INTERNVIT_NORMS[vc.norm_type],
        norm_eps=float(vc.layer_norm_eps),
        activation=vision_act(vc.hidden_act, path),
        qkv_bias=bool(vc.attention_bias),
        qk_norm=bool(vc.use_qk_norm),
        qk_norm_eps=1e-6,  # transformers' InternVLVisionRMSNorm default, whatever layer_norm_eps
        layer_scale=True,
        post_norm=(not vc.use_mean_pooling) and layer == -1,
    )
    tokens = added_tokens(path)
    spec = ModelSpec(
        name=path.name,
        vit=vit,
        projector=ProjectorSpec(
            type="pixel_shuffle_mlp",
            downsample=float(cfg.downsample_ratio),
            activation=vision_act(cfg.projector_hidden_act, path),
        ),
        llm=with_tie(language(tc, arch, path), cfg.tie_word_embeddings),
        image_token_id=int(cfg.image_token_id),
        image_start_id=tokens.get("<img>", -1),
        image_end_id=tokens.get("</img>", -1),
        source=str(path),
    )
    return HFModel(path, spec, "internvl", arch, total)
