"""What every family's config reading shares: the checkpoint model type, its error, JSON and
tokenizer files, and the LLM part (Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE,
InternLM2) of a transformers text config or an InternLM2 config dict.

Why shared: the four families put their LLMs in different places of config.json, but an LLM is
read the same way wherever it sits, and its limits (RoPE scaling, windowed attention, biases,
mixture of experts) are refused with the same messages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatron_omnibal.models.spec import LanguageSpec, ModelSpec

LLM_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "InternLM2ForCausalLM": "internlm2",
}
TEXT_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                    "qwen3_moe": "qwen3_moe"}  # fmt: skip
# Mixture-of-experts LLMs of released checkpoints (InternVL3.5-20B-A4B's) the stage module does
# not build.
MOE_LLMS = {
    "GptOssForCausalLM": "GPT-OSS",
    "gpt_oss": "GPT-OSS",
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
    family: str  # the name of its family (models.families.registry)
    llm_arch: str  # llama | mistral | qwen2 | qwen3 | qwen3_moe | internlm2
    vit_checkpoint_layers: int  # ViT layers stored (LLaVA's last one is never used)


def config_value(cfg: Any, key: str, default: Any = None) -> Any:
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def need(cond: bool, path: Path, msg: str) -> None:
    if not cond:
        raise HFConfigError(f"{path / 'config.json'}: {msg}")


def checked_towers(
    path: Path, tower: str, model_type: str, supported: str
) -> tuple[Any, Any, Any]:
    """The checkpoint's transformers config and its vision and text configs, once the `tower`
    ("vision" or "text") config's model_type is `model_type` (`supported` says what is)."""
    cfg = transformers_config(path)
    found = getattr(cfg, f"{tower}_config").model_type
    need(found == model_type, path, f"{tower}_config.model_type {found!r}: {supported}")
    return cfg, cfg.vision_config, cfg.text_config


def load_json(path: Path) -> dict:
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


def added_tokens(path: Path) -> dict[str, int]:
    """Special tokens the tokenizer files of `path` add (content -> id); empty without them."""
    out: dict[str, int] = {}
    cfg = path / "tokenizer_config.json"
    if cfg.is_file():
        for tid, tok in (load_json(cfg).get("added_tokens_decoder") or {}).items():
            if isinstance(tok, dict) and "content" in tok:
                out[tok["content"]] = int(tid)
    tok_json = path / "tokenizer.json"
    if tok_json.is_file():
        for tok in load_json(tok_json).get("added_tokens") or []:
            out.setdefault(tok["content"], int(tok["id"]))
    return out


def feature_layers(layer: Any, total: int, path: Path, field: str) -> int:
    """How many ViT layers feed the projector for HF's `hidden_states[layer]` (index 0 is the
    embedding output, i the output of layer i)."""
    need(
        isinstance(layer, int) and not isinstance(layer, bool),
        path,
        f"{field}={layer!r}: features from several layers are not supported",
    )
    used = total + 1 + layer if layer < 0 else layer
    need(1 <= used <= total, path, f"{field}={layer} selects no ViT layer of {total}")
    return used


def rope(text: Any, path: Path) -> tuple[float, float]:
    """(RoPE base, Llama-3 scaling factor or 0) from `rope_parameters` (transformers 5) or
    `rope_scaling` (`type` or `rope_type`, older configs and InternLM2's dict)."""
    params = config_value(text, "rope_parameters")
    params = params if isinstance(params, dict) else {}
    scaling = config_value(text, "rope_scaling")
    scaling = scaling if isinstance(scaling, dict) else params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    kind = "default" if kind == "mrope" else kind  # M-RoPE's sections: see mrope_section
    need(
        kind in ("default", "llama3"),
        path,
        f"RoPE scaling {kind!r} is not supported by the stage module (plain RoPE and Llama-3's "
        "'llama3' scaling are)",
    )
    theta = params.get("rope_theta")
    theta = float(theta if theta is not None else config_value(text, "rope_theta", 10000.0))
    if kind == "default":
        return theta, 0.0
    for key, fixed in LLAMA3_FIXED.items():
        value = scaling.get(key)
        need(
            value is not None and float(value) == fixed,
            path,
            f"llama3 RoPE scaling with {key}={value!r}: megatron-core builds only {fixed:g}",
        )
    factor = scaling.get("factor")
    need(
        isinstance(factor, (int, float)) and factor >= 1,
        path,
        f"llama3 RoPE scaling factor {factor!r}: expected a number >= 1",
    )
    return theta, float(factor)


def experts(text: Any, path: Path) -> dict[str, Any]:
    """The LanguageSpec fields of a Qwen3-MoE text config's experts: every layer's MLP a
    mixture of `num_experts` (transformers 5 saves `num_local_experts`) experts of width
    `moe_intermediate_size`, `num_experts_per_tok` of them per token. Layer patterns megatron-core
    is not given (dense layers among the MoE ones) and shared experts are refused by key.

    `router_aux_loss_coef` becomes `moe_aux_loss_coeff` as it is: megatron-core adds its switch
    loss per MoE layer (their sum, about num_layers times transformers' one loss over all
    layers' router logits, which transformers adds only with `output_router_logits`); the
    checkpoint's coefficient is kept so fine-tuning balances the experts as its authors set."""
    count = config_value(text, "num_experts")
    count = config_value(text, "num_local_experts") if count is None else count
    need(isinstance(count, int) and count > 0, path,
         f"num_experts / num_local_experts {count!r}: expected a positive integer")  # fmt: skip
    dense = config_value(text, "mlp_only_layers") or []
    need(not dense, path, f"mlp_only_layers={list(dense)}: dense layers among the MoE layers "
         "are not built (every layer must be a MoE layer)")  # fmt: skip
    step = config_value(text, "decoder_sparse_step", 1)
    need(step == 1, path, f"decoder_sparse_step={step}: only 1 (a MoE layer in every layer) "
         "is built")  # fmt: skip
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        value = config_value(text, key)
        need(not value, path, f"{key}={value}: shared experts are not built")
    top_k = config_value(text, "num_experts_per_tok")
    need(isinstance(top_k, int) and 1 <= top_k <= count, path,
         f"num_experts_per_tok {top_k!r}: expected 1..{count} (num_experts)")  # fmt: skip
    width = config_value(text, "moe_intermediate_size")
    need(isinstance(width, int) and width > 0, path,
         f"moe_intermediate_size {width!r}: expected a positive integer")  # fmt: skip
    coeff = config_value(text, "router_aux_loss_coef", 0.0) or 0.0
    need(isinstance(coeff, (int, float)) and coeff >= 0, path,
         f"router_aux_loss_coef {coeff!r}: expected a number >= 0")  # fmt: skip
    return {
        "num_experts": count,
        "moe_top_k": top_k,
        "moe_ffn_hidden_size": width,
        "moe_norm_topk_prob": bool(config_value(text, "norm_topk_prob", False)),
        "moe_aux_loss_coeff": float(coeff),
    }


def language(text: Any, arch: str, path: Path) -> LanguageSpec:
    """The LLM part from a transformers text config (or an InternLM2 config dict); a Qwen3-MoE
    (`arch` qwen3_moe) is a Qwen3 with experts."""
    moe = experts(text, path) if arch == "qwen3_moe" else {}
    arch = "qwen3" if arch == "qwen3_moe" else arch
    heads = int(config_value(text, "num_attention_heads"))
    hidden = int(config_value(text, "hidden_size"))
    act = config_value(text, "hidden_act", "silu")
    need(act == "silu", path, f"LLM hidden_act {act!r}: only SiLU-gated MLPs are supported")
    if arch == "mistral":
        window = config_value(text, "sliding_window")
        need(
            window is None or window >= int(config_value(text, "max_position_embeddings")),
            path,
            f"sliding_window={window}: windowed attention is not supported",
        )
    if arch in ("qwen2", "qwen3"):
        need(
            not config_value(text, "use_sliding_window", False),
            path,
            "use_sliding_window=true: windowed attention is not supported",
        )
    if arch in ("llama", "mistral", "qwen3"):
        need(not config_value(text, "mlp_bias", False), path, "mlp_bias=true is not supported")
        qkv_bias = bool(config_value(text, "attention_bias", False))
        need(not qkv_bias, path, "attention_bias=true (biased o_proj) is not supported")
    elif arch == "internlm2":
        need(not config_value(text, "bias", False), path, "InternLM2 bias=true is not supported")
        qkv_bias = False
    else:  # qwen2: q, k and v always carry a bias, o_proj none
        qkv_bias = True
    head_dim = config_value(text, "head_dim") or hidden // heads
    theta, scaling = rope(text, path)
    return LanguageSpec(
        num_layers=int(config_value(text, "num_hidden_layers")),
        hidden_size=hidden,
        ffn_hidden_size=int(config_value(text, "intermediate_size")),
        num_attention_heads=heads,
        num_query_groups=int(config_value(text, "num_key_value_heads") or heads),
        kv_channels=int(head_dim),
        vocab_size=int(config_value(text, "vocab_size")),
        norm="rmsnorm",
        norm_eps=float(config_value(text, "rms_norm_eps", 1e-6)),
        activation="silu",
        gated_mlp=True,
        qkv_bias=qkv_bias,
        qk_norm=arch == "qwen3",
        rotary_base=theta,
        rope_scaling_factor=scaling,
        max_position_embeddings=int(config_value(text, "max_position_embeddings", 32768)),
        **moe,
    )


def transformers_config(path: Path) -> Any:
    """The directory's config through transformers' own classes (their defaults apply)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (KeyError, ValueError, TypeError) as exc:
        raise HFConfigError(f"{path / 'config.json'}: transformers rejects it ({exc})") from None


def mrope_section(text: Any, path: Path) -> tuple[int, ...]:
    """M-RoPE's (time, height, width) frequency sections of a Qwen2.5-VL text config."""
    for key in ("rope_parameters", "rope_scaling"):
        params = config_value(text, key)
        if isinstance(params, dict) and params.get("mrope_section"):
            return tuple(int(x) for x in params["mrope_section"])
    raise HFConfigError(f"{path / 'config.json'}: no mrope_section in rope_parameters/rope_scaling")


def text_arch(model_type: str, path: Path) -> str:
    """The LLM kind of a transformers text config; unbuilt mixture-of-experts LLMs named as
    such."""
    need(
        model_type not in MOE_LLMS,
        path,
        f"text_config.model_type {model_type!r}: {MOE_LLMS.get(model_type)} is a "
        f"mixture-of-experts LLM, not supported (supported: {', '.join(TEXT_MODEL_TYPES)})",
    )
    arch = TEXT_MODEL_TYPES.get(model_type)
    need(
        arch is not None,
        path,
        f"text_config.model_type {model_type!r} is not supported "
        f"(supported: {', '.join(TEXT_MODEL_TYPES)})",
    )
    return arch


def vision_act(name: str, path: Path) -> str:
    known = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh"}
    need(name in known, path, f"activation {name!r} is not supported ({', '.join(known)})")
    return known[name]


def with_tie(llm: LanguageSpec, tie: bool) -> LanguageSpec:
    return replace(llm, tie_embeddings=bool(tie))


