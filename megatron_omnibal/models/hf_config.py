"""Read a Hugging Face checkpoint directory's config.json into a ModelSpec.

Why here and not in each command: `omnibal plan/stats/convert --model HF_DIR` and the Megatron
entry point must agree on the architecture, and every field the stage module builds (norms,
biases, layer scale, QK-norm, feature layer, tied head, RoPE base) must come from the checkpoint
itself, never from a guess. Families:

- transformers' `internvl` (InternVLForConditionalGeneration) and `llava`
  (LlavaForConditionalGeneration): parsed with transformers' own config classes (defaults,
  renamed fields and RoPE parameters as transformers applies them).
- OpenGVLab's remote-code `internvl_chat` (what most InternVL checkpoints on disk are): its
  JSON is read directly (no remote code runs); its LLM is InternLM2, Qwen2/2.5, Qwen3 or Llama.
- transformers' `qwen2_5_vl` (Qwen2_5_VLForConditionalGeneration): the native-resolution
  vision tower, the patch merger and a Qwen2 LLM with M-RoPE; the hub's flat config.json (text
  keys at the top level, `rope_scaling` of type mrope) and the re-saved one (`text_config`)
  both, through transformers' own Qwen2_5_VLConfig.

LLMs: Llama 2/3.x (Llama-3 RoPE scaling with megatron-core's fixed frequency bands), Mistral,
Qwen2/2.5 (qkv bias), Qwen3 (per-head QK-norm, its own head size, no biases), InternLM2.
Anything the stage module cannot build exactly (another RoPE scaling, several feature layers,
a mixture-of-experts or unknown LLM, a model type planned but not built yet) is an error that
names the field, never an approximation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatron_omnibal.models.presets import QWEN25_MERGER, QWEN25_VIT
from megatron_omnibal.models.spec import LanguageSpec, ModelSpec, ProjectorSpec, VisionSpec

FAMILIES = ("internvl", "internvl_chat", "llava", "qwen2_5_vl")
LLM_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "InternLM2ForCausalLM": "internlm2",
}
TEXT_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
# LLMs of released checkpoints (InternVL3.5's MoE variants) the stage module does not build.
MOE_LLMS = {
    "Qwen3MoeForCausalLM": "Qwen3-MoE",
    "GptOssForCausalLM": "GPT-OSS",
    "qwen3_moe": "Qwen3-MoE",
    "gpt_oss": "GPT-OSS",
}
# Model types recognised but not built yet: read_hf refuses them with the reason.
NOT_YET = {
    "qwen2_vl": "Qwen2-VL's vision tower (full attention in every block, LayerNorm, a plain "
    "MLP) is not the Qwen2.5-VL tower the stage module builds",
    "qwen3_vl": "Qwen3-VL's vision tower (DeepStack features, learned positions) and "
    "interleaved M-RoPE have no stage module",
    "qwen3_vl_moe": "Qwen3-VL-MoE is a mixture-of-experts LLM with Qwen3-VL's vision tower, "
    "neither built by the stage module",
}
# megatron-core 0.19's Llama-3 RoPE scaling fixes everything but the factor.
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip


class HFConfigError(ValueError):
    """A checkpoint directory whose architecture the stage module cannot build exactly."""


@dataclass(frozen=True)
class HFModel:
    """What a checkpoint directory holds: the spec, and how its tensors are laid out."""

    path: Path
    spec: ModelSpec
    family: str  # one of FAMILIES
    llm_arch: str  # llama | mistral | qwen2 | qwen3 | internlm2
    vit_checkpoint_layers: int  # ViT layers stored (LLaVA's last one is never used)


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def _need(cond: bool, path: Path, msg: str) -> None:
    if not cond:
        raise HFConfigError(f"{path / 'config.json'}: {msg}")


def _checked_towers(
    path: Path, tower: str, model_type: str, supported: str
) -> tuple[Any, Any, Any]:
    """The checkpoint's transformers config and its vision and text configs, once the `tower`
    ("vision" or "text") config's model_type is `model_type` (`supported` says what is)."""
    cfg = _transformers_config(path)
    found = getattr(cfg, f"{tower}_config").model_type
    _need(found == model_type, path, f"{tower}_config.model_type {found!r}: {supported}")
    return cfg, cfg.vision_config, cfg.text_config


def _load_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFConfigError(
            f"{path}: no such file (is this a Hugging Face model directory?)"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise HFConfigError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise HFConfigError(f"{path}: expected a JSON object")
    return doc


def _added_tokens(path: Path) -> dict[str, int]:
    """Special tokens the tokenizer files of `path` add (content -> id); empty without them."""
    out: dict[str, int] = {}
    cfg = path / "tokenizer_config.json"
    if cfg.is_file():
        for tid, tok in (_load_json(cfg).get("added_tokens_decoder") or {}).items():
            if isinstance(tok, dict) and "content" in tok:
                out[tok["content"]] = int(tid)
    tok_json = path / "tokenizer.json"
    if tok_json.is_file():
        for tok in _load_json(tok_json).get("added_tokens") or []:
            out.setdefault(tok["content"], int(tok["id"]))
    return out


def _feature_layers(layer: Any, total: int, path: Path, field: str) -> int:
    """How many ViT layers feed the projector for HF's `hidden_states[layer]` (index 0 is the
    embedding output, i the output of layer i)."""
    _need(
        isinstance(layer, int) and not isinstance(layer, bool),
        path,
        f"{field}={layer!r}: features from several layers are not supported",
    )
    used = total + 1 + layer if layer < 0 else layer
    _need(1 <= used <= total, path, f"{field}={layer} selects no ViT layer of {total}")
    return used


def _rope(text: Any, path: Path) -> tuple[float, float]:
    """(RoPE base, Llama-3 scaling factor or 0) from `rope_parameters` (transformers 5) or
    `rope_scaling` (`type` or `rope_type`, older configs and InternLM2's dict)."""
    params = _get(text, "rope_parameters")
    params = params if isinstance(params, dict) else {}
    scaling = _get(text, "rope_scaling")
    scaling = scaling if isinstance(scaling, dict) else params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    kind = "default" if kind == "mrope" else kind  # M-RoPE's sections: see _mrope_section
    _need(
        kind in ("default", "llama3"),
        path,
        f"RoPE scaling {kind!r} is not supported by the stage module (plain RoPE and Llama-3's "
        "'llama3' scaling are)",
    )
    theta = params.get("rope_theta")
    theta = float(theta if theta is not None else _get(text, "rope_theta", 10000.0))
    if kind == "default":
        return theta, 0.0
    for key, fixed in LLAMA3_FIXED.items():
        value = scaling.get(key)
        _need(
            value is not None and float(value) == fixed,
            path,
            f"llama3 RoPE scaling with {key}={value!r}: megatron-core builds only {fixed:g}",
        )
    factor = scaling.get("factor")
    _need(
        isinstance(factor, (int, float)) and factor >= 1,
        path,
        f"llama3 RoPE scaling factor {factor!r}: expected a number >= 1",
    )
    return theta, float(factor)


def _language(text: Any, arch: str, path: Path) -> LanguageSpec:
    """The LLM part from a transformers text config (or an InternLM2 config dict)."""
    heads = int(_get(text, "num_attention_heads"))
    hidden = int(_get(text, "hidden_size"))
    act = _get(text, "hidden_act", "silu")
    _need(act == "silu", path, f"LLM hidden_act {act!r}: only SiLU-gated MLPs are supported")
    if arch == "mistral":
        window = _get(text, "sliding_window")
        _need(
            window is None or window >= int(_get(text, "max_position_embeddings")),
            path,
            f"sliding_window={window}: windowed attention is not supported",
        )
    if arch in ("qwen2", "qwen3"):
        _need(
            not _get(text, "use_sliding_window", False),
            path,
            "use_sliding_window=true: windowed attention is not supported",
        )
    if arch in ("llama", "mistral", "qwen3"):
        _need(not _get(text, "mlp_bias", False), path, "mlp_bias=true is not supported")
        qkv_bias = bool(_get(text, "attention_bias", False))
        _need(not qkv_bias, path, "attention_bias=true (biased o_proj) is not supported")
    elif arch == "internlm2":
        _need(not _get(text, "bias", False), path, "InternLM2 bias=true is not supported")
        qkv_bias = False
    else:  # qwen2: q, k and v always carry a bias, o_proj none
        qkv_bias = True
    head_dim = _get(text, "head_dim") or hidden // heads
    theta, scaling = _rope(text, path)
    return LanguageSpec(
        num_layers=int(_get(text, "num_hidden_layers")),
        hidden_size=hidden,
        ffn_hidden_size=int(_get(text, "intermediate_size")),
        num_attention_heads=heads,
        num_query_groups=int(_get(text, "num_key_value_heads") or heads),
        kv_channels=int(head_dim),
        vocab_size=int(_get(text, "vocab_size")),
        norm="rmsnorm",
        norm_eps=float(_get(text, "rms_norm_eps", 1e-6)),
        activation="silu",
        gated_mlp=True,
        qkv_bias=qkv_bias,
        qk_norm=arch == "qwen3",
        rotary_base=theta,
        rope_scaling_factor=scaling,
        max_position_embeddings=int(_get(text, "max_position_embeddings", 32768)),
    )


def _transformers_config(path: Path) -> Any:
    """The directory's config through transformers' own classes (their defaults apply)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (KeyError, ValueError, TypeError) as exc:
        raise HFConfigError(f"{path / 'config.json'}: transformers rejects it ({exc})") from None


def _internvl(path: Path, doc: dict) -> HFModel:
    cfg = _transformers_config(path)
    vc, tc = cfg.vision_config, cfg.text_config
    arch = _text_arch(tc.model_type, path)
    total = int(vc.num_hidden_layers)
    layer = cfg.vision_feature_layer
    used = _feature_layers(layer, total, path, "vision_feature_layer")
    size = vc.image_size[0] if isinstance(vc.image_size, (list, tuple)) else vc.image_size
    patch = vc.patch_size[0] if isinstance(vc.patch_size, (list, tuple)) else vc.patch_size
    _need(
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
        norm={"layer_norm": "layernorm", "rms_norm": "rmsnorm"}[vc.norm_type],
        norm_eps=float(vc.layer_norm_eps),
        activation=_vision_act(vc.hidden_act, path),
        qkv_bias=bool(vc.attention_bias),
        qk_norm=bool(vc.use_qk_norm),
        qk_norm_eps=1e-6,  # transformers' InternVLVisionRMSNorm default, whatever layer_norm_eps
        layer_scale=True,
        post_norm=(not vc.use_mean_pooling) and layer == -1,
    )
    tokens = _added_tokens(path)
    spec = ModelSpec(
        name=path.name,
        vit=vit,
        projector=ProjectorSpec(
            type="pixel_shuffle_mlp",
            downsample=float(cfg.downsample_ratio),
            activation=_vision_act(cfg.projector_hidden_act, path),
        ),
        llm=_with_tie(_language(tc, arch, path), cfg.tie_word_embeddings),
        image_token_id=int(cfg.image_token_id),
        image_start_id=tokens.get("<img>", -1),
        image_end_id=tokens.get("</img>", -1),
        source=str(path),
    )
    return HFModel(path, spec, "internvl", arch, total)


def _llava(path: Path, doc: dict) -> HFModel:
    cfg, vc, tc = _checked_towers(
        path, "vision", "clip_vision_model", "only CLIP vision towers are supported"
    )
    arch = _text_arch(tc.model_type, path)
    total = int(vc.num_hidden_layers)
    used = _feature_layers(cfg.vision_feature_layer, total, path, "vision_feature_layer")
    vit = VisionSpec(
        num_layers=used,
        hidden_size=int(vc.hidden_size),
        ffn_hidden_size=int(vc.intermediate_size),
        num_attention_heads=int(vc.num_attention_heads),
        image_size=int(vc.image_size),
        patch_size=int(vc.patch_size),
        norm="layernorm",
        norm_eps=float(vc.layer_norm_eps),
        activation=_vision_act(vc.hidden_act, path),
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
            activation=_vision_act(cfg.projector_hidden_act, path),
            bias=bool(cfg.multimodal_projector_bias),
        ),
        llm=_with_tie(_language(tc, arch, path), cfg.tie_word_embeddings),
        image_token_id=int(cfg.image_token_id),
        source=str(path),
    )
    return HFModel(path, spec, "llava", arch, total)


def _internvl_chat(path: Path, doc: dict) -> HFModel:
    vc, lc = doc.get("vision_config"), doc.get("llm_config")
    _need(isinstance(vc, dict) and isinstance(lc, dict), path, "no vision_config / llm_config")
    archs = lc.get("architectures") or []
    moe = [MOE_LLMS[a] for a in archs if a in MOE_LLMS]
    _need(
        not moe,
        path,
        f"llm_config.architectures {archs}: {', '.join(moe)} is a mixture-of-experts LLM, "
        f"not supported (dense LLMs are: {', '.join(LLM_ARCHS)})",
    )
    arch = next((LLM_ARCHS[a] for a in archs if a in LLM_ARCHS), None)
    _need(
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
    used = _feature_layers(doc.get("select_layer", -1), total, path, "select_layer")
    size = int(doc.get("force_image_size") or vc["image_size"])
    _need(
        size == int(vc["image_size"]),
        path,
        f"force_image_size {size} differs from vision_config.image_size {vc['image_size']}: "
        "interpolated position embeddings are not supported",
    )
    ps_version = doc.get("ps_version", "v1")
    _need(ps_version in ("v1", "v2"), path, f"ps_version {ps_version!r}: expected v1 or v2")
    vit = VisionSpec(
        num_layers=used,
        hidden_size=int(vc["hidden_size"]),
        ffn_hidden_size=int(vc["intermediate_size"]),
        num_attention_heads=int(vc["num_attention_heads"]),
        image_size=size,
        patch_size=int(vc["patch_size"]),
        norm={"layer_norm": "layernorm", "rms_norm": "rmsnorm"}[vc.get("norm_type", "rms_norm")],
        norm_eps=float(vc.get("layer_norm_eps", 1e-6)),
        activation=_vision_act(vc.get("hidden_act", "gelu"), path),
        qkv_bias=bool(vc.get("qkv_bias", False)),
        qk_norm=bool(vc.get("qk_normalization", False)),
        qk_norm_eps=float(vc.get("layer_norm_eps", 1e-6)),
        layer_scale=True,
    )
    tokens = _added_tokens(path)
    _need(
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
        llm=_with_tie(_language(text, arch, path), bool(lc.get("tie_word_embeddings", False))),
        image_token_id=tokens["<IMG_CONTEXT>"],
        image_start_id=tokens.get("<img>", -1),
        image_end_id=tokens.get("</img>", -1),
        source=str(path),
    )
    return HFModel(path, spec, "internvl_chat", arch, total)


def _mrope_section(text: Any, path: Path) -> tuple[int, ...]:
    """M-RoPE's (time, height, width) frequency sections of a Qwen2.5-VL text config."""
    for key in ("rope_parameters", "rope_scaling"):
        params = _get(text, key)
        if isinstance(params, dict) and params.get("mrope_section"):
            return tuple(int(x) for x in params["mrope_section"])
    raise HFConfigError(f"{path / 'config.json'}: no mrope_section in rope_parameters/rope_scaling")


def _qwen2_5_vl(path: Path, doc: dict) -> HFModel:
    cfg, vc, tc = _checked_towers(path, "text", "qwen2_5_vl_text", "expected qwen2_5_vl_text")
    sides = {name: getattr(vc, name) for name in ("patch_size", "temporal_patch_size")}
    _need(
        all(isinstance(v, int) for v in sides.values()),
        path,
        f"vision_config {sides}: only square patches of one size are supported",
    )
    _need(
        int(vc.out_hidden_size) == int(tc.hidden_size),
        path,
        f"vision_config.out_hidden_size {vc.out_hidden_size} differs from the LLM's hidden "
        f"size {tc.hidden_size}",
    )
    _need(vc.hidden_act == "silu", path, f"vision hidden_act {vc.hidden_act!r}: only silu")
    merge, patch = int(vc.spatial_merge_size), int(vc.patch_size)
    # The architecture's fixed facts (norms, biases, SwiGLU, 2D RoPE) are the presets' tower.
    vit = replace(
        QWEN25_VIT,
        num_layers=int(vc.depth),
        hidden_size=int(vc.hidden_size),
        ffn_hidden_size=int(vc.intermediate_size),
        num_attention_heads=int(vc.num_heads),
        image_size=patch * merge,
        patch_size=patch,
        temporal_patch_size=int(vc.temporal_patch_size),
        spatial_merge_size=merge,
        window_size=int(vc.window_size),
        fullatt_block_indexes=tuple(int(i) for i in vc.fullatt_block_indexes),
        rope_theta=float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 1e4)),
        tokens_per_second=float(vc.tokens_per_second),
    )
    llm = _language(tc, "qwen2", path)
    spec = ModelSpec(
        name=path.name,
        vit=vit,
        projector=replace(
            QWEN25_MERGER, downsample=1 / merge, hidden_size=int(vc.hidden_size) * merge**2
        ),
        llm=replace(
            llm,
            mrope_section=_mrope_section(tc, path),
            tie_embeddings=bool(cfg.tie_word_embeddings),
        ),
        image_token_id=int(cfg.image_token_id),
        image_start_id=int(cfg.vision_start_token_id),
        image_end_id=int(cfg.vision_end_token_id),
        source=str(path),
    )
    return HFModel(path, spec, "qwen2_5_vl", "qwen2", int(vc.depth))


def _text_arch(model_type: str, path: Path) -> str:
    """The LLM kind of a transformers text config; mixture-of-experts LLMs named as such."""
    _need(
        model_type not in MOE_LLMS,
        path,
        f"text_config.model_type {model_type!r}: {MOE_LLMS.get(model_type)} is a "
        f"mixture-of-experts LLM, not supported (dense LLMs are: {', '.join(TEXT_MODEL_TYPES)})",
    )
    arch = TEXT_MODEL_TYPES.get(model_type)
    _need(
        arch is not None,
        path,
        f"text_config.model_type {model_type!r} is not supported "
        f"(supported: {', '.join(TEXT_MODEL_TYPES)})",
    )
    return arch


def _vision_act(name: str, path: Path) -> str:
    known = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh"}
    _need(name in known, path, f"activation {name!r} is not supported ({', '.join(known)})")
    return known[name]


def _with_tie(llm: LanguageSpec, tie: bool) -> LanguageSpec:
    return replace(llm, tie_embeddings=bool(tie))


def read_hf(path: str | Path) -> HFModel:
    """The model in checkpoint directory `path` (its config.json; tokenizer files for the
    image token ids where the config does not hold them)."""
    path = Path(path)
    doc = _load_json(path / "config.json")
    kind = doc.get("model_type")
    readers = {
        "internvl": _internvl,
        "llava": _llava,
        "internvl_chat": _internvl_chat,
        "qwen2_5_vl": _qwen2_5_vl,
    }
    if kind in NOT_YET:
        raise HFConfigError(
            f"{path / 'config.json'}: model_type {kind!r} is not supported yet: {NOT_YET[kind]} "
            f"(supported: {', '.join(readers)})"
        )
    if kind not in readers:
        raise HFConfigError(
            f"{path / 'config.json'}: model_type {kind!r} is not supported "
            f"(supported: {', '.join(readers)})"
        )
    return readers[kind](path, doc)


def spec_from_hf(path: str | Path) -> ModelSpec:
    """The ModelSpec of a Hugging Face checkpoint directory."""
    return read_hf(path).spec
