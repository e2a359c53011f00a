"""OpenGVLab's remote-code `internvl_chat` config.json -> its ModelSpec: the JSON is read
directly (no remote code runs); its LLM is InternLM2, Qwen2/2.5, Qwen3 or Llama, named in
`llm_config.architectures`, and its image token id comes from the tokenizer files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_omnibal.models.families.shared.config import (
    LLM_ARCHS,
    MOE_LLMS,
    HFModel,
    added_tokens,
    feature_layers,
    language,
    need,
    vision_act,
    with_tie,
)
from megatron_omnibal.models.families.shared.internvit import INTERNVIT_NORMS
from megatron_omnibal.models.spec import ModelSpec, ProjectorSpec, VisionSpec


def read_config(path: Path, doc: dict) -> HFModel:
    vc, lc = doc.get("vision_config"), doc.get("llm_config")
    need(isinstance(vc, dict) and isinstance(lc, dict), path, "no vision_config / llm_config")
    archs = lc.get("architectures") or []
    moe = [MOE_LLMS[a] for a in archs if a in MOE_LLMS]
    need(
        not moe,
        path,
        f"llm_config.architectures {archs}: {', '.join(moe)} is a mixture-of-experts LLM, "
        f"not supported (supported: {', '.join(LLM_ARCHS)})",
    )
    arch = next((LLM_ARCHS[a] for a in archs if a in LLM_ARCHS), None)
    need(
        arch is not None,
        path,
        f"llm_config.architectures {archs}: supported are {', '.join(LLM_ARCHS)}",
    )
    if arch != "internlm2":
        from transformers import AutoConfig

        text: Any = AutoConfig.for_model(arch, **{k: v for k, v in lc.items() if k != "model_type"})
    else:
        text = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bias": True, **lc}
    total = int(vc["num_hidden_layers"])
    used = feature_layers(doc.get("select_layer", -1), total, path, "select_layer")
    size = int(doc.get("force_image_size") or vc["image_size"])
    need(
        size == int(vc["image_size"]),
        path,
        f"force_image_size {size} differs from vision_config.image_size {vc['image_size']}: "
        "interpolated position embeddings are not supported",
    )
    ps_version = doc.get("ps_version", "v1")
    need(ps_version in ("v1", "v2"), path, f"ps_version {ps_version!r}: expected v1 or v2")
    vit = VisionSpec(
        num_layers=used,
        hidden_size=int(vc["hidden_size"]),
        ffn_hidden_size=int(vc["intermediate_size"]),
        num_attention_heads=int(vc["num_attention_heads"]),
        image_size=size,
        patch_size=int(vc["patch_size"]),
        norm=INTERNVIT_NORMS[vc.get("norm_type", "rms_norm")],
        norm_eps=float(vc.get("layer_norm_eps", 1e-6)),
        activation=vision_act(vc.get("hidden_act", "gelu"), path),
        qkv_bias=bool(vc.get("qkv_bias", False)),
        qk_norm=bool(vc.get("qk_normalization", False)),
        qk_norm_eps=float(vc.get("layer_norm_eps", 1e-6)),
        layer_scale=True,
    )
    tokens = added_tokens(path)
    need(
        "<IMG_CONTEXT>" in tokens,
        path,
        "no <IMG_CONTEXT> token in tokenizer_config.json / tokenizer.json of this directory "
        "(InternVL-Chat takes the image token id from its tokenizer)",
    )
    spec = ModelSpec(
        name=path.name,
        vit=vit,
        projector=ProjectorSpec(
            type="pixel_shuffle_mlp",
            downsample=float(doc.get("downsample_ratio", 0.5)),
            shuffle_version=int(ps_version[1]),
        ),
        llm=with_tie(language(text, arch, path), bool(lc.get("tie_word_embeddings", False))),
        image_token_id=tokens["<IMG_CONTEXT>"],
        image_start_id=tokens.get("<img>", -1),
        image_end_id=tokens.get("</img>", -1),
        source=str(path),
    )
    return HFModel(path, spec, "internvl_chat", arch, total)
