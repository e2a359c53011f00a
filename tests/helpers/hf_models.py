"""Tiny random Hugging Face VLMs for the tests, built from config objects with the installed
transformers and saved locally (nothing is downloaded).

Families (each shaped like the real one, a few layers wide):
- internvl_6b: transformers' InternVL with an InternViT-6B-like tower (RMSNorm, QK-norm across
  heads, layer scale, no qkv bias, a final LayerNorm) and a Qwen2 LLM (qkv bias, tied head);
  3 vision heads, so TP=2 needs a padded dummy head, as InternViT-6B's 25 heads do.
- internvl_300m: InternViT-300M-like (LayerNorm, qkv bias) and a Llama LLM (GQA, own head).
- internvl_chat: OpenGVLab's remote-code layout (`vision_model.*`, fused `attn.qkv`, `mlp1.*`,
  InternLM2's fused `wqkv`), written from a transformers InternVL model by an independent inverse
  mapping, so transformers' forward of that model is the oracle.
- llava: LLaVA-1.5-like (CLIP with pre-LayerNorm and quick_gelu, feature layer -2, MLP
  projector, Llama).
Newer LLMs in the same towers (`text=`): qwen3 (InternVL3.5: per-head QK-norm, a head size of
16 on a width of 32 with 4 heads, no biases), qwen3_moe (InternVL3.5-30B-A3B: the same with
MOE_TEXT's experts, stored one tensor per expert) and llama3 (Llama-3.x RoPE: rope_type llama3,
factor 32, theta 500000, so the 8-wide heads have a frequency in each of its three bands).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

IMG_CONTEXT, IMG_START, IMG_END = 150, 151, 152  # InternVL's special tokens in the tiny vocab
LLAVA_IMAGE = 120
# A tiny Qwen3-MoE LLM (InternVL3.5-30B-A3B's shape, scaled down): 4 experts of width 24, top 2,
# the picked probabilities renormalised, a non-zero load-balancing coefficient.
MOE_TEXT = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
            "norm_topk_prob": True, "router_aux_loss_coef": 0.01}  # fmt: skip


@dataclass
class Built:
    path: Path
    model: torch.nn.Module  # the transformers model whose forward is the oracle
    family: str
    image_token: int
    tokens_per_tile: int
    image_size: int


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """No norm weight stays 1, no bias 0, no layer scale 0.1: a mapping mistake shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _text_config(kind: str, vocab: int, tie: bool, layers: int = 4) -> dict:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig,
           "llama3": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}[kind]  # fmt: skip
    extra: dict = {"rope_theta": 5000.0, "max_position_embeddings": 256}
    if kind in ("qwen3", "qwen3_moe"):
        extra["head_dim"] = 16
    if kind == "qwen3_moe":
        extra.update(MOE_TEXT)
    if kind == "llama3":
        extra = {
            "max_position_embeddings": 131072,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "rope_theta": 500000.0,
        }  # fmt: skip
    return cls(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        vocab_size=vocab,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        **extra,
    ).to_dict()


def _tokenizer_files(path: Path, tokens: dict[str, int]) -> None:
    """The added-token part of a tokenizer config (all the converter reads of it)."""
    decoder = {str(i): {"content": c, "special": True} for c, i in tokens.items()}
    (path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": decoder}))


def internvl(
    path: Path,
    six_b: bool,
    text: str | None = None,
    tie: bool | None = None,
    final_norm: bool | None = None,
    seed: int = 0,
    llm_layers: int = 4,
) -> Built:
    """transformers' InternVL: 6B-like tower (default: Qwen2, tied, final LayerNorm) or
    300M-like (default: Llama, own head, no final LayerNorm); `llm_layers` LLM layers."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

    text = text or ("qwen2" if six_b else "llama")
    tie = six_b if tie is None else tie
    final_norm = six_b if final_norm is None else final_norm
    heads = 3 if six_b else 4
    vision = InternVLVisionConfig(
        hidden_size=16 * heads,
        num_hidden_layers=4,
        num_attention_heads=heads,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        norm_type="rms_norm" if six_b else "layer_norm",
        use_qk_norm=six_b,
        attention_bias=not six_b,
        use_mean_pooling=not final_norm,
        layer_norm_eps=1e-6,
    )
    cfg = InternVLConfig(
        vision_config=vision.to_dict(),
        text_config=_text_config(text, 160, tie=tie, layers=llm_layers),
        image_token_id=IMG_CONTEXT,
        image_seq_length=4,
        downsample_ratio=0.5,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = InternVLForConditionalGeneration(cfg).eval()
    _perturb(model, seed + 1)
    model.save_pretrained(path)
    _tokenizer_files(path, {"<IMG_CONTEXT>": IMG_CONTEXT, "<img>": IMG_START, "</img>": IMG_END})
    return Built(path, model, "internvl", IMG_CONTEXT, 4, 16)


def internvl_chat(
    path: Path, seed: int = 0, text: str = "internlm2", six_b: bool = True, llm_layers: int = 4
) -> Built:
    """OpenGVLab's layout of a transformers InternVL model without a final norm and with its
    own head: a 6B-like tower (RMSNorm, QK-norm) or a 300M-like one (LayerNorm, qkv bias);
    a Llama-shaped LLM stored as InternLM2 (`wqkv`), or a Qwen2/Qwen3 LLM stored as
    transformers does (`llm_config.architectures` names it)."""
    from safetensors.torch import save_file

    native = internvl(
        path.with_name(path.name + "_native"), six_b=six_b,
        text="llama" if text == "internlm2" else text, tie=False, final_norm=False, seed=seed,
        llm_layers=llm_layers,
    )  # fmt: skip
    model = native.model
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    vc, tc = model.config.vision_config, model.config.text_config
    heads, groups = tc.num_attention_heads, tc.num_key_value_heads
    dim = tc.hidden_size // heads
    V, T = "model.vision_tower.", "model.language_model."
    out = {
        "vision_model.embeddings.class_embedding": sd[V + "embeddings.cls_token"],
        "vision_model.embeddings.position_embedding": sd[V + "embeddings.position_embeddings"],
    }
    for p in ("weight", "bias"):
        out[f"vision_model.embeddings.patch_embedding.{p}"] = sd[
            V + f"embeddings.patch_embeddings.projection.{p}"
        ]
    norm_params = qkv_params = ("weight",) if six_b else ("weight", "bias")
    for i in range(vc.num_hidden_layers):
        src, dst = f"{V}encoder.layer.{i}.", f"vision_model.encoder.layers.{i}."
        a = src + "attention."
        for p in qkv_params:
            out[dst + f"attn.qkv.{p}"] = torch.cat(
                [sd[a + f"{x}_proj.{p}"] for x in "qkv"]
            )  # [Q_all; K_all; V_all]
        if six_b:
            for x in ("q_norm", "k_norm"):
                out[dst + f"attn.{x}.weight"] = sd[a + f"{x}.weight"]
        for p in ("weight", "bias"):
            out[dst + f"attn.proj.{p}"] = sd[a + f"projection_layer.{p}"]
            out[dst + f"mlp.fc1.{p}"] = sd[src + f"mlp.fc1.{p}"]
            out[dst + f"mlp.fc2.{p}"] = sd[src + f"mlp.fc2.{p}"]
        for p in norm_params:
            out[dst + f"norm1.{p}"] = sd[src + f"layernorm_before.{p}"]
            out[dst + f"norm2.{p}"] = sd[src + f"layernorm_after.{p}"]
        out[dst + "ls1"] = sd[src + "lambda_1"]
        out[dst + "ls2"] = sd[src + "lambda_2"]
    for dst, src in (("mlp1.0", "layer_norm"), ("mlp1.1", "linear_1"), ("mlp1.3", "linear_2")):
        for p in ("weight", "bias"):
            out[f"{dst}.{p}"] = sd[f"model.multi_modal_projector.{src}.{p}"]
    if text == "internlm2":
        out.update(_internlm2_llm(sd, tc.num_hidden_layers, heads, groups, dim))
        llm_config = {
            "architectures": ["InternLM2ForCausalLM"],
            "hidden_size": tc.hidden_size,
            "num_hidden_layers": tc.num_hidden_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": groups,
            "intermediate_size": tc.intermediate_size,
            "vocab_size": tc.vocab_size,
            "rms_norm_eps": tc.rms_norm_eps,
            "rope_theta": 5000.0,
            "max_position_embeddings": 256,
            "bias": False,
            "tie_word_embeddings": False,
        }
    elif text == "qwen3_moe":  # one tensor per expert, as transformers saves (not holds) them
        from safetensors.torch import load_file

        saved = load_file(native.path / "model.safetensors")
        out.update({k: t for k, t in saved.items() if k.startswith("language_model.")})
    else:  # transformers' own LLM names under `language_model.`
        out.update({"language_model.model." + k[len(T):]: t for k, t in sd.items()
                    if k.startswith(T)})  # fmt: skip
        out["language_model.lm_head.weight"] = sd["lm_head.weight"]
    if text != "internlm2":
        arch = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}[text]  # fmt: skip
        llm_config = {**tc.to_dict(), "architectures": [arch]}
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(path / "model.safetensors"))
    config = {
        "model_type": "internvl_chat",
        "architectures": ["InternVLChatModel"],
        "select_layer": -1,
        "downsample_ratio": 0.5,
        "ps_version": "v2",
        "template": "internlm2-chat" if text == "internlm2" else "internvl2_5",
        "force_image_size": 16,
        "vision_config": {
            "hidden_size": vc.hidden_size,
            "num_hidden_layers": vc.num_hidden_layers,
            "num_attention_heads": vc.num_attention_heads,
            "intermediate_size": vc.intermediate_size,
            "image_size": 16,
            "patch_size": 4,
            "qkv_bias": not six_b,
            "qk_normalization": six_b,
            "norm_type": "rms_norm" if six_b else "layer_norm",
            "layer_norm_eps": 1e-6,
            "hidden_act": "gelu",
        },
        "llm_config": llm_config,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer_files(path, {"<IMG_CONTEXT>": IMG_CONTEXT, "<img>": IMG_START, "</img>": IMG_END})
    return Built(path, model, "internvl_chat", IMG_CONTEXT, 4, 16)


def _internlm2_llm(
    sd: dict[str, torch.Tensor], layers: int, heads: int, groups: int, dim: int
) -> dict[str, torch.Tensor]:
    """A transformers Llama's tensors under InternLM2's names (fused per-group `wqkv`)."""
    T = "model.language_model."
    out = {
        "language_model.model.tok_embeddings.weight": sd[T + "embed_tokens.weight"],
        "language_model.model.norm.weight": sd[T + "norm.weight"],
        "language_model.output.weight": sd["lm_head.weight"],
    }
    for i in range(layers):
        src, dst = f"{T}layers.{i}.", f"language_model.model.layers.{i}."
        q = sd[src + "self_attn.q_proj.weight"].reshape(groups, heads // groups, dim, -1)
        k, v = (sd[src + f"self_attn.{x}_proj.weight"].reshape(groups, 1, dim, -1) for x in "kv")
        out[dst + "attention.wqkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
        out[dst + "attention.wo.weight"] = sd[src + "self_attn.o_proj.weight"]
        out[dst + "attention_norm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "ffn_norm.weight"] = sd[src + "post_attention_layernorm.weight"]
        out[dst + "feed_forward.w1.weight"] = sd[src + "mlp.gate_proj.weight"]
        out[dst + "feed_forward.w3.weight"] = sd[src + "mlp.up_proj.weight"]
        out[dst + "feed_forward.w2.weight"] = sd[src + "mlp.down_proj.weight"]
    return out


def llava(path: Path, seed: int = 0, text: str = "llama", llm_layers: int = 4) -> Built:
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    cfg = LlavaConfig(
        vision_config=vision.to_dict(),
        text_config=_text_config(text, 128, tie=False, layers=llm_layers),
        image_token_id=LLAVA_IMAGE,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=16,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg).eval()
    _perturb(model, seed + 1)
    model.save_pretrained(path)
    return Built(path, model, "llava", LLAVA_IMAGE, 16, 16)


QWEN_IMAGE, QWEN_VIDEO, QWEN_START, QWEN_END = 150, 151, 152, 153


def qwen2_5_vl(path: Path, seed: int = 0, flat: bool = False, llm_layers: int = 4,
               tie: bool = False) -> Built:  # fmt: skip
    """Qwen2.5-VL: 4 vision blocks (2 heads of 16, window 56 px = 2x2 merged units of 2x2
    patches of 14 px, full attention in blocks 1 and 3), the merger, a Qwen2 LLM with M-RoPE
    (head size 8: mrope_section [1, 1, 2]). `flat`: config.json with the text keys at the top
    level and the hub's tensor names (`visual.*`, `model.layers.*`), as the released
    checkpoints; otherwise transformers' nested `text_config` and its own names."""
    from safetensors.torch import save_file
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = {
        "depth": 4, "hidden_size": 32, "intermediate_size": 40, "num_heads": 2,
        "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 56,
        "fullatt_block_indexes": [1, 3], "out_hidden_size": 32, "hidden_act": "silu",
        "in_channels": 3,
    }  # fmt: skip
    text = _text_config("qwen2", 160, tie=tie, layers=llm_layers)
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0,
                               "mrope_section": [1, 1, 2]}  # fmt: skip
    text.pop("rope_theta", None)
    cfg = Qwen2_5_VLConfig(
        vision_config=vision, text_config={**text, "model_type": "qwen2_5_vl_text"},
        image_token_id=QWEN_IMAGE, video_token_id=QWEN_VIDEO, vision_start_token_id=QWEN_START,
        vision_end_token_id=QWEN_END, tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    _perturb(model, seed + 1)
    model.save_pretrained(path)
    # transformers 5 saves the hub's tensor names (`visual.*`, `model.layers.*`)
    if flat:  # the hub's config.json: text keys at the top level, mrope in rope_scaling
        doc = json.loads((path / "config.json").read_text())
        text_doc = doc.pop("text_config")
        rope = text_doc.pop("rope_parameters")
        text_doc.pop("model_type", None)
        doc.update({k: v for k, v in text_doc.items() if k not in doc})
        doc["rope_theta"] = rope["rope_theta"]
        doc["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
        (path / "config.json").write_text(json.dumps(doc, indent=2))
    else:  # transformers 4.5x's re-saved names: `model.visual.*`, `model.language_model.*`
        renamed = {}
        for k, v in model.state_dict().items():
            if not (tie and k == "lm_head.weight"):
                renamed[k] = v.detach().clone().contiguous()
        for f in path.glob("*.safetensors"):
            f.unlink()
        save_file(renamed, str(path / "model.safetensors"), metadata={"format": "pt"})
    return Built(path, model, "qwen2_5_vl", QWEN_IMAGE, 1, 28)


def qwen3_vl(path: Path, seed: int = 0, hub: bool = False, llm_layers: int = 4,
             tie: bool = False) -> Built:
    """Qwen3-VL: tests/helpers/qwen3_vl.py's tiny model (4 ViT layers of width 32 with a 4 x 4
    position table, DeepStack taps [2, 0, 3], a Qwen3 LLM with interleaved M-RoPE [4, 2, 2])
    with `llm_layers` LLM layers. `hub`: config.json as the hub's checkpoints lay it out
    (`text_config.rope_scaling` with mrope_interleaved beside rope_theta, the vision config's
    model_type "qwen3_vl"); otherwise transformers 5's own save (`rope_parameters`). Its
    tensors are saved as transformers saves them (`model.visual.*`, `model.language_model.*`,
    `lm_head.*`), the hub's names too."""
    from transformers import Qwen3VLForConditionalGeneration

    from tests.helpers import qwen3_vl as tiny

    cfg = tiny.hf_config()
    cfg.text_config.num_hidden_layers = llm_layers
    cfg.tie_word_embeddings = tie
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(cfg).float().eval()
    _perturb(model, seed + 1)
    model.save_pretrained(path)
    if hub:
        doc = json.loads((path / "config.json").read_text())
        text, vision = doc["text_config"], doc["vision_config"]
        rope = text.pop("rope_parameters")
        text["rope_theta"] = rope.pop("rope_theta")
        text["rope_scaling"] = rope
        vision["model_type"] = "qwen3_vl"
        (path / "config.json").write_text(json.dumps(doc, indent=2))
    return Built(path, model, "qwen3_vl", tiny.IMAGE_TOKEN, 1, 8)


def qwen3_vl_moe(path: Path, seed: int = 0, hub: bool = True, llm_layers: int = 3) -> Built:
    """Qwen3-VL-MoE: the tiny Qwen3-VL above with MOE_TEXT's experts (4 of width 24, top 2) in
    every one of its `llm_layers` LLM layers, fused as transformers holds them. `hub`: the
    expert tensors as the hub stores them (`gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]);
    otherwise as transformers 5 saves them ([E, 2I, H], [E, H, I]: it transposes the hub's on
    load and writes them back untransposed)."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    from tests.helpers import qwen3_vl as tiny

    dense = tiny.hf_config()
    text = {**dense.text_config.to_dict(), "num_hidden_layers": llm_layers,
            **{k: v for k, v in MOE_TEXT.items() if k != "norm_topk_prob"}}  # fmt: skip
    text.pop("model_type", None)
    cfg = Qwen3VLMoeConfig(vision_config=dense.vision_config.to_dict(), text_config=text,
                           image_token_id=dense.image_token_id,
                           video_token_id=dense.video_token_id,
                           vision_start_token_id=dense.vision_start_token_id,
                           vision_end_token_id=dense.vision_end_token_id,
                           tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(cfg).float().eval()
    _perturb(model, seed + 1)
    model.save_pretrained(path)
    if hub:
        saved = load_file(path / "model.safetensors")
        fused = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
        saved = {k: t.transpose(1, 2).contiguous() if k.endswith(fused) else t
                 for k, t in saved.items()}  # fmt: skip
        save_file(saved, str(path / "model.safetensors"), metadata={"format": "pt"})
    return Built(path, model, "qwen3_vl_moe", tiny.IMAGE_TOKEN, 1, 8)


def edited_copy(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint directory `src` at `dst` whose config.json `edit(doc)` changed."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    doc = json.loads((dst / "config.json").read_text())
    edit(doc)
    (dst / "config.json").write_text(json.dumps(doc))
    return dst
