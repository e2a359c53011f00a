"""Named model specs: the real architectures the planner prices by name, and toy models for
tests, the demo and the CPU benchmarks. Each real preset names the config it was read from;
`omnibal ... --model HF_DIR` reads a checkpoint's own config.json instead (models.hf_config).
"""

from __future__ import annotations

from typing import Any, TypeVar

from megatron_omnibal.models.spec import LanguageSpec, ModelSpec, ProjectorSpec, VisionSpec

T = TypeVar("T")


def _vit(
    layers: int, hidden: int, ffn: int, heads: int, image: int, patch: int, **rest: Any
) -> VisionSpec:
    """A vision tower from its shape, in the order its config lists it; the rest by name."""
    return VisionSpec(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                      num_attention_heads=heads, image_size=image, patch_size=patch, **rest)


def _llm(layers: int, hidden: int, ffn: int, heads: int, **rest: Any) -> LanguageSpec:
    """An LLM from its shape (layers, width, MLP width, heads); the rest by name."""
    return LanguageSpec(num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn,
                        num_attention_heads=heads, **rest)


# OpenGVLab/InternViT-6B-448px-V1-5 (and -V1-2, whose 48 layers were cut to the same 45):
# hidden 3200, MLP 12800, 25 heads of 128, RMSNorm eps 1e-6, no qkv bias, QK-norm, layer scale.
INTERNVIT_6B = _vit(45, 3200, 12800, 25, 448, 14, norm="rmsnorm", qkv_bias=False, qk_norm=True,
                    layer_scale=True)
# OpenGVLab/InternViT-300M-448px: 24 layers, 1024, 4096, 16 heads, LayerNorm, qkv bias.
INTERNVIT_300M = _vit(24, 1024, 4096, 16, 448, 14, layer_scale=True)
# openai/clip-vit-large-patch14-336 under LLaVA-1.5: vision_feature_layer -2 runs 23 of its 24
# layers; pre-LayerNorm, quick_gelu, LayerNorm eps 1e-5, no patch-embedding bias.
CLIP_L_336 = _vit(23, 1024, 4096, 16, 336, 14, norm_eps=1e-5, activation="quick_gelu",
                  patch_bias=False, pre_norm=True)
_PIXEL_SHUFFLE = ProjectorSpec(type="pixel_shuffle_mlp", downsample=0.5)
# Qwen/Qwen2.5-VL-{3B,7B,32B,72B}-Instruct vision_config (the same tower in all four): 32 blocks,
# hidden 1280, SwiGLU MLP 3420 with biases, 16 heads of 80, RMSNorm eps 1e-6, qkv bias, Conv3d
# patch embedding (14 px, 2 frames, no bias), 2D RoPE; windows of 112 px (8x8 patches) except
# the full-attention blocks 7, 15, 23, 31; a tile here is one 2x2 merge group (28 px).
QWEN25_VIT = _vit(32, 1280, 3420, 16, 28, 14, norm="rmsnorm", activation="silu",
                  class_token=False, patch_bias=False, gated_mlp=True, native_resolution=True,
                  temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                  fullatt_block_indexes=(7, 15, 23, 31))
# Its merger: RMSNorm(1280) per patch, 2x2 patches concatenated, Linear(5120, 5120), exact GELU,
# Linear(5120, out_hidden_size = the LLM's hidden size).
QWEN25_MERGER = ProjectorSpec(type="patch_merger", downsample=0.5, hidden_size=5120, norm_eps=1e-6)


def _qwen25_vl(name: str, source: str, layers: int, hidden: int, ffn: int, heads: int,
               kv_heads: int) -> ModelSpec:
    """A Qwen2.5-VL (its -Instruct config.json) from its LLM's shape: the Qwen2.5 LLM with qkv
    bias, vocab 152064, RMSNorm eps 1e-6, rope_theta 1e6, 128000 positions and M-RoPE sections
    [16, 24, 24]; image tokens <|image_pad|> 151655 between <|vision_start|> 151652 and
    <|vision_end|> 151653."""
    llm = _llm(layers, hidden, ffn, heads, num_query_groups=kv_heads, vocab_size=152064,
               qkv_bias=True, rotary_base=1e6, max_position_embeddings=128000,
               mrope_section=(16, 24, 24))
    return ModelSpec(name=name, vit=QWEN25_VIT, projector=QWEN25_MERGER, llm=llm,
                     image_token_id=151655, image_start_id=151652, image_end_id=151653,
                     source=source)


def _qwen3(layers: int, hidden: int, ffn: int, heads: int) -> LanguageSpec:
    """A Qwen3 dense LLM (Qwen/Qwen3-*B config.json): heads of 128, 8 KV heads, per-head QK-norm,
    no biases, RMSNorm eps 1e-6, vocab 151936, rope_theta 1e6, 40960 positions."""
    return _llm(layers, hidden, ffn, heads, num_query_groups=8, kv_channels=128,
                vocab_size=151936, qk_norm=True, rotary_base=1e6, max_position_embeddings=40960)

_MLP2X_GELU = ProjectorSpec(type="mlp", downsample=1.0)


def _qwen3_vl_vit(layers: int, hidden: int, ffn: int, deepstack: tuple[int, ...]) -> VisionSpec:
    """Qwen3-VL's tower (Qwen/Qwen3-VL-*-Instruct vision_config): 16 heads, LayerNorm eps 1e-6,
    a plain GELU-tanh MLP with biases, qkv and patch-embedding biases, Conv3d patches of 16 px x
    2 frames, a learned 48 x 48 position table interpolated to each image plus 2D RoPE, full
    attention in every layer (no windows), 2x2 merge groups (a tile here: 32 px, one LLM token);
    the hidden states after the `deepstack` layers feed the DeepStack mergers."""
    return _vit(layers, hidden, ffn, 16, 32, 16, activation="gelu_tanh", class_token=False,
                native_resolution=True, temporal_patch_size=2, spatial_merge_size=2,
                num_position_embeddings=2304, deepstack_indexes=deepstack)


# Qwen3-VL-2B/4B: 24 x 1024, MLP 4096, DeepStack taps 5, 11, 17; 8B and larger: 27 x 1152,
# MLP 4304, taps 8, 16, 24.
QWEN3_VL_VIT_S = _qwen3_vl_vit(24, 1024, 4096, (5, 11, 17))
QWEN3_VL_VIT_L = _qwen3_vl_vit(27, 1152, 4304, (8, 16, 24))


def _qwen3_vl_merger(vit: VisionSpec) -> ProjectorSpec:
    """Qwen3-VL's merger: LayerNorm of each patch, 2x2 patches concatenated, Linear(4 Cv, 4 Cv),
    exact GELU, Linear(4 Cv, the LLM's hidden size); each DeepStack merger is the same MLP with
    its LayerNorm over the concatenated group."""
    return ProjectorSpec(type="patch_merger", downsample=0.5, hidden_size=4 * vit.hidden_size,
                         norm_eps=1e-6, merger_norm="layernorm")


def _qwen3_vl(name: str, source: str, vit: VisionSpec, llm: LanguageSpec) -> ModelSpec:
    """A Qwen3-VL: its tower and merger, and the Qwen3 LLM given; image tokens <|image_pad|>
    151655 between <|vision_start|> 151652 and <|vision_end|> 151653."""
    return ModelSpec(name=name, vit=vit, projector=_qwen3_vl_merger(vit), llm=llm,
                     image_token_id=151655, image_start_id=151652, image_end_id=151653,
                     source=source)


def _qwen3_vl_llm(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                  **rest: Any) -> LanguageSpec:
    """Qwen3-VL's text_config: Qwen3 with heads of 128, per-head QK-norm, no biases, RMSNorm eps
    1e-6, vocab 151936, rope_theta 5e6, 262144 positions, interleaved M-RoPE [24, 20, 20]."""
    return _llm(layers, hidden, ffn, heads, num_query_groups=kv_heads, kv_channels=128,
                vocab_size=151936, qk_norm=True, rotary_base=5e6,
                max_position_embeddings=262144, mrope_section=(24, 20, 20),
                mrope_interleaved=True, **rest)


def _moe(experts: int, top_k: int, width: int) -> dict[str, Any]:
    """Qwen3-MoE's expert fields: every layer's MLP a mixture of `experts` of `width`, `top_k`
    per token, the picked probabilities renormalised, router_aux_loss_coef 0.001."""
    return {"num_experts": experts, "moe_top_k": top_k, "moe_ffn_hidden_size": width,
            "moe_norm_topk_prob": True, "moe_aux_loss_coeff": 0.001}


def _internvl(name: str, vit: VisionSpec, llm: LanguageSpec, source: str) -> ModelSpec:
    """An InternVL: its tower, pixel shuffle (0.5) and an MLP into the LLM."""
    return ModelSpec(name=name, vit=vit, projector=_PIXEL_SHUFFLE, llm=llm, source=source)


def _llava(name: str, llm: LanguageSpec, image_token_id: int, source: str) -> ModelSpec:
    """LLaVA-1.5's recipe: CLIP-L/336 (its second-to-last layer) and a 2-layer GELU MLP."""
    return ModelSpec(name=name, vit=CLIP_L_336, projector=_MLP2X_GELU, llm=llm,
                     image_token_id=image_token_id, source=source)

PRESETS: dict[str, ModelSpec] = {
    # OpenGVLab/InternVL-Chat-V1-5 llm_config (InternLM2-chat-20B): 48 layers, 6144, 16384,
    # 48 heads, 8 KV heads, vocab 92553, RMSNorm eps 1e-5, rope_theta 1e6.
    "internvl-6b-20b": _internvl(
        "internvl-6b-20b", INTERNVIT_6B,
        _llm(48, 6144, 16384, 48, num_query_groups=8, vocab_size=92553, norm_eps=1e-5,
             rotary_base=1e6),
        "OpenGVLab/InternVL-Chat-V1-5 (the OmniBal paper's 6+20B)"),
    # NousResearch/Nous-Hermes-2-Yi-34B (InternVL-Chat-V1-2's LLM): 60 layers, 7168, 20480,
    # 56 heads, 8 KV heads, vocab 64000, RMSNorm eps 1e-5, rope_theta 5e6.
    "internvl-6b-34b": _internvl(
        "internvl-6b-34b", INTERNVIT_6B,
        _llm(60, 7168, 20480, 56, num_query_groups=8, vocab_size=64000, norm_eps=1e-5,
             rotary_base=5e6, max_position_embeddings=4096),
        "OpenGVLab/InternVL-Chat-V1-2 (the OmniBal paper's 6+34B)"),
    # OpenGVLab/InternVL2-8B llm_config (InternLM2.5-7B-chat): 32 layers, 4096, 14336,
    # 32 heads, 8 KV heads, vocab 92553, RMSNorm eps 1e-5, rope_theta 1e6.
    "internvl2-8b": _internvl(
        "internvl2-8b", INTERNVIT_300M,
        _llm(32, 4096, 14336, 32, num_query_groups=8, vocab_size=92553, norm_eps=1e-5,
             rotary_base=1e6),
        "OpenGVLab/InternVL2-8B"),
    # llava-hf/llava-1.5-7b-hf text_config (Vicuna-7B v1.5): 32 layers, 4096, 11008,
    # 32 heads, vocab 32064 with <image> = 32000, RMSNorm eps 1e-5, 4096 positions.
    "llava-1.5-7b": _llava(
        "llava-1.5-7b",
        _llm(32, 4096, 11008, 32, vocab_size=32064, norm_eps=1e-5,
             max_position_embeddings=4096),
        32000, "llava-hf/llava-1.5-7b-hf"),
    # llava-hf/llava-1.5-13b-hf text_config (Vicuna-13B v1.5): 40 layers, 5120, 13824,
    # 40 heads, vocab 32064.
    "llava-1.5-13b": _llava(
        "llava-1.5-13b",
        _llm(40, 5120, 13824, 40, vocab_size=32064, norm_eps=1e-5,
             max_position_embeddings=4096),
        32000, "llava-hf/llava-1.5-13b-hf"),
    # OpenGVLab/InternVL3-8B llm_config (Qwen2.5-7B): 28 layers, 3584, 18944, 28 heads,
    # 4 KV heads, qkv bias, vocab 151674, RMSNorm eps 1e-6, rope_theta 1e6.
    "internvl3-8b": _internvl(
        "internvl3-8b", INTERNVIT_300M,
        _llm(28, 3584, 18944, 28, num_query_groups=4, vocab_size=151674, qkv_bias=True,
             rotary_base=1e6),
        "OpenGVLab/InternVL3-8B"),
    # OpenGVLab/InternVL3_5-8B llm_config (Qwen3-8B): 36 layers, 4096, 12288, 32 heads of
    # 128, 8 KV heads, per-head QK-norm, no biases, vocab 151936, rope_theta 1e6.
    "internvl3.5-8b": _internvl(
        "internvl3.5-8b", INTERNVIT_300M,
        _qwen3(36, 4096, 12288, 32),
        "OpenGVLab/InternVL3_5-8B"),
    # InternViT-6B-448px-V2_5: the 45-layer InternViT-6B.
    # OpenGVLab/InternVL3_5-38B llm_config (Qwen3-32B): 64 layers, 5120, 25600, 64 heads of
    # 128 (8192 wide, not 5120), 8 KV heads, per-head QK-norm, vocab 151936, rope_theta 1e6.
    "internvl3.5-38b": _internvl(
        "internvl3.5-38b", INTERNVIT_6B,
        _qwen3(64, 5120, 25600, 64),
        "OpenGVLab/InternVL3_5-38B"),
    # LLaVA-1.5's recipe on meta-llama/Llama-3.1-8B-Instruct: 32 layers, 4096, 14336,
    # 32 heads, 8 KV heads, vocab 128256 (+1 <image>), RMSNorm eps 1e-5, rope_theta 5e5
    # with llama3 scaling factor 8 (low 1, high 4, original 8192), 131072 positions.
    "llava-llama3.1-8b": _llava(
        "llava-llama3.1-8b",
        _llm(32, 4096, 14336, 32, num_query_groups=8, vocab_size=128257, norm_eps=1e-5,
             rotary_base=5e5, rope_scaling_factor=8.0, max_position_embeddings=131072),
        128256, "meta-llama/Llama-3.1-8B-Instruct in LLaVA-1.5 (CLIP-L/336, MLP projector)"),
    # Qwen/Qwen2.5-VL-7B-Instruct text part: 28 layers, 3584, 18944, 28 heads, 4 KV heads.
    "qwen2.5-vl-7b": _qwen25_vl("qwen2.5-vl-7b", "Qwen/Qwen2.5-VL-7B-Instruct",
                                28, 3584, 18944, 28, 4),
    # Qwen/Qwen2.5-VL-72B-Instruct text part (transformers' Qwen2_5_VLTextConfig defaults are
    # this shape): 80 layers, 8192, 29568, 64 heads, 8 KV heads.
    "qwen2.5-vl-72b": _qwen25_vl("qwen2.5-vl-72b", "Qwen/Qwen2.5-VL-72B-Instruct",
                                 80, 8192, 29568, 64, 8),
    # Qwen/Qwen3-VL-{2B,4B}-Instruct text_config: 28 x 2048 (MLP 6144, 16 heads) and 36 x 2560
    # (MLP 9728, 32 heads), 8 KV heads, tied embeddings; the small tower.
    "qwen3-vl-2b": _qwen3_vl("qwen3-vl-2b", "Qwen/Qwen3-VL-2B-Instruct", QWEN3_VL_VIT_S,
                             _qwen3_vl_llm(28, 2048, 6144, 16, 8, tie_embeddings=True)),
    "qwen3-vl-4b": _qwen3_vl("qwen3-vl-4b", "Qwen/Qwen3-VL-4B-Instruct", QWEN3_VL_VIT_S,
                             _qwen3_vl_llm(36, 2560, 9728, 32, 8, tie_embeddings=True)),
    # Qwen/Qwen3-VL-{8B,32B}-Instruct text_config: 36 x 4096 (MLP 12288, 32 heads) and 64 x 5120
    # (MLP 25600, 64 heads of 128: 8192 wide), 8 KV heads, untied; the large tower.
    "qwen3-vl-8b": _qwen3_vl("qwen3-vl-8b", "Qwen/Qwen3-VL-8B-Instruct", QWEN3_VL_VIT_L,
                             _qwen3_vl_llm(36, 4096, 12288, 32, 8)),
    "qwen3-vl-32b": _qwen3_vl("qwen3-vl-32b", "Qwen/Qwen3-VL-32B-Instruct", QWEN3_VL_VIT_L,
                              _qwen3_vl_llm(64, 5120, 25600, 64, 8)),
    # Qwen/Qwen3-VL-30B-A3B-Instruct text_config (Qwen3-30B-A3B's shape): 48 x 2048, 32 heads,
    # 4 KV heads, 128 experts of 768, top 8; 235B-A22B: 94 x 4096, 64 heads, 4 KV heads, 128
    # experts of 1536, top 8. intermediate_size (6144, 12288) is unused: every layer is sparse.
    "qwen3-vl-30b-a3b": _qwen3_vl("qwen3-vl-30b-a3b", "Qwen/Qwen3-VL-30B-A3B-Instruct",
                                  QWEN3_VL_VIT_L,
                                  _qwen3_vl_llm(48, 2048, 6144, 32, 4, **_moe(128, 8, 768))),
    "qwen3-vl-235b-a22b": _qwen3_vl("qwen3-vl-235b-a22b", "Qwen/Qwen3-VL-235B-A22B-Instruct",
                                    QWEN3_VL_VIT_L,
                                    _qwen3_vl_llm(94, 4096, 12288, 64, 4, **_moe(128, 8, 1536))),
    # OpenGVLab/InternVL3_5-30B-A3B llm_config (Qwen3-30B-A3B): 48 x 2048, 32 heads of 128, 4 KV
    # heads, per-head QK-norm, 128 experts of 768, top 8, vocab 151936, rope_theta 1e6.
    "internvl3.5-30b-a3b": _internvl(
        "internvl3.5-30b-a3b", INTERNVIT_300M,
        _llm(48, 2048, 6144, 32, num_query_groups=4, kv_channels=128, vocab_size=151936,
             qk_norm=True, rotary_base=1e6, max_position_embeddings=40960, **_moe(128, 8, 768)),
        "OpenGVLab/InternVL3_5-30B-A3B"),
    # Tests and the demo's training: a few layers, tiny widths, 16px tiles of 4px patches -> 4
    # tokens per tile.
    "tiny": ModelSpec(
        name="tiny",
        vit=_vit(4, 32, 64, 4, 16, 4),
        projector=ProjectorSpec(type="pixel_shuffle_mlp", downsample=0.5, hidden_size=48),
        llm=_llm(4, 32, 64, 4, num_query_groups=2, vocab_size=128),
        source="test model",
    ),
    # The CPU demo and benchmark: on the shipped InternVL data (mean 3.95 tiles, 1135 tokens of
    # which 256 per real tile, here 16) the ViT's matmul FLOPs per sample are ~1.05x the LLM's,
    # as in InternVL-Chat-V1-2 6+20B (~1.04x): vision costs as much relative to the LLM.
    "small": ModelSpec(
        name="small",
        vit=_vit(12, 192, 768, 6, 64, 8),
        projector=ProjectorSpec(type="pixel_shuffle_mlp", downsample=0.5, hidden_size=256),
        llm=_llm(8, 256, 704, 8, num_query_groups=4, vocab_size=2048),
        source="CPU demo model",
    ),
}


def named_preset(table: dict[str, T], name: str, kind: str, otherwise: str) -> T:
    """`table[name]`, or an error listing the known names and what else may be given."""
    if name not in table:
        raise ValueError(f"unknown {kind} preset '{name}' (known: {', '.join(table)}; {otherwise})")
    return table[name]


def get_preset(name: str) -> ModelSpec:
    """The preset `name`, or an error listing the known ones."""
    return named_preset(
        PRESETS, name, "model",
        "or give a JSON/YAML model_spec file or a Hugging Face checkpoint directory",
    )  # fmt: skip
