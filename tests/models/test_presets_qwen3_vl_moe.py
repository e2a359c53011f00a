"""The Qwen3-VL and mixture-of-experts presets against the released models' parameter counts.

Oracle: transformers builds each model from its released config's shapes on the meta device
(no weights, no download) and counts its parameters; the preset's spec must count exactly the
same, and round to the size the model card publishes.
"""

from __future__ import annotations

import pytest

from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.models.spec import ModelSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def spec_total(spec: ModelSpec) -> int:
    """Every parameter of the spec: tower, merger(s), LLM layers (every expert), embedding,
    untied head, final norm."""
    v, llm = spec.vit, spec.llm
    embed = llm.vocab_size * llm.hidden_size * (1 if llm.tie_embeddings else 2)
    return (spec.patch_embed_params + v.num_layers * v.layer_params + spec.projector_params
            + spec.deepstack_merger_params + llm.num_layers * llm.layer_params + embed
            + llm.hidden_size)  # fmt: skip


def _qwen3_vl_config(name: str):
    """The released config's shapes (Qwen/<model>-Instruct config.json), as transformers 5
    reads them."""
    small = name in ("qwen3-vl-2b", "qwen3-vl-4b")
    text = {
        "qwen3-vl-2b": (28, 2048, 6144, 16, 8),
        "qwen3-vl-4b": (36, 2560, 9728, 32, 8),
        "qwen3-vl-8b": (36, 4096, 12288, 32, 8),
        "qwen3-vl-32b": (64, 5120, 25600, 64, 8),
        "qwen3-vl-30b-a3b": (48, 2048, 6144, 32, 4),
        "qwen3-vl-235b-a22b": (94, 4096, 12288, 64, 4),
    }[name]
    layers, hidden, ffn, heads, kv = text
    text_config = dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=ffn,
                       num_attention_heads=heads, num_key_value_heads=kv, head_dim=128,
                       vocab_size=151936)  # fmt: skip
    vision_config = dict(
        depth=24 if small else 27, hidden_size=1024 if small else 1152,
        intermediate_size=4096 if small else 4304, num_heads=16, patch_size=16,
        temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
        out_hidden_size=hidden, deepstack_visual_indexes=[5, 11, 17] if small else [8, 16, 24],
    )  # fmt: skip
    if name.endswith("a3b") or name.endswith("a22b"):
        text_config.update(num_experts=128, num_experts_per_tok=8,
                           moe_intermediate_size=768 if hidden == 2048 else 1536)
        return (transformers.Qwen3VLMoeConfig(vision_config=vision_config,
                                              text_config=text_config),
                transformers.Qwen3VLMoeForConditionalGeneration)  # fmt: skip
    return (transformers.Qwen3VLConfig(vision_config=vision_config, text_config=text_config,
                                       tie_word_embeddings=small),
            transformers.Qwen3VLForConditionalGeneration)  # fmt: skip


def _internvl35_30b_config():
    """OpenGVLab/InternVL3_5-30B-A3B-HF's shapes: InternViT-300M (no final norm: mean pooling
    off in OpenGVLab's layout means none is used) and Qwen3-30B-A3B, untied."""
    config = transformers.InternVLConfig(
        vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                           num_attention_heads=16, image_size=[448, 448], patch_size=[14, 14],
                           use_qk_norm=False, layer_scale_init_value=0.1, attention_bias=True,
                           use_mean_pooling=True, norm_type="layer_norm"),
        text_config=dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048,
                         intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                         head_dim=128, vocab_size=151936, num_experts=128,
                         num_experts_per_tok=8, moe_intermediate_size=768,
                         tie_word_embeddings=False),
        downsample_ratio=0.5, projector_hidden_act="gelu", tie_word_embeddings=False,
    )  # fmt: skip
    return config, transformers.InternVLForConditionalGeneration


def _hf_count(config, cls) -> int:
    with torch.device("meta"):
        model = cls(config)
    return sum(p.numel() for p in model.parameters())  # tied weights once


# The model cards' published sizes (billions, as rounded there).
PUBLISHED_B = {
    "qwen3-vl-2b": 2.13, "qwen3-vl-4b": 4.44, "qwen3-vl-8b": 8.77, "qwen3-vl-32b": 33.4,
    "qwen3-vl-30b-a3b": 31.1, "qwen3-vl-235b-a22b": 236, "internvl3.5-30b-a3b": 30.8,
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED_B))
def test_preset_counts_the_released_model(name: str) -> None:
    spec = get_preset(name)
    config, cls = (_internvl35_30b_config() if name.startswith("internvl")
                   else _qwen3_vl_config(name))  # fmt: skip
    assert spec_total(spec) == _hf_count(config, cls)
    published = PUBLISHED_B[name]
    assert float(f"{spec_total(spec) / 1e9:.3g}") == published


@pytest.mark.parametrize(("name", "active_b"), [
    ("qwen3-vl-30b-a3b", 3), ("internvl3.5-30b-a3b", 3), ("qwen3-vl-235b-a22b", 22)])
def test_moe_presets_activate_their_named_share(name: str, active_b: int) -> None:
    """A3B / A22B: the LLM's parameters a token uses (top-k experts, router, attention,
    embedding and head), rounded to the billion the name gives."""
    llm = get_preset(name).llm
    dense = llm.layer_params - llm.num_experts * llm.expert_params
    active = llm.num_layers * (dense + llm.moe_top_k * llm.expert_params)
    active += 2 * llm.vocab_size * llm.hidden_size
    assert round(active / 1e9) == active_b


def test_qwen3_vl_towers_and_llms() -> None:
    """What the planner and the stage module read: full attention everywhere, the DeepStack
    taps, the merger width 4 Cv, interleaved M-RoPE, one LLM token per 32 px tile."""
    for name in ("qwen3-vl-2b", "qwen3-vl-8b", "qwen3-vl-30b-a3b"):
        spec = get_preset(name)
        v = spec.vit
        assert (v.window_size, v.fullatt_block_indexes, v.native_resolution) == (0, (), True)
        assert spec.projector.hidden_size == 4 * v.hidden_size
        assert spec.llm.mrope_interleaved and spec.llm.mrope_section == (24, 20, 20)
        assert spec.tokens_per_tile == 1 and v.patch_dim == 3 * 2 * 16 * 16
    assert get_preset("qwen3-vl-2b").vit.deepstack_indexes == (5, 11, 17)
    assert get_preset("qwen3-vl-32b").vit.deepstack_indexes == (8, 16, 24)
    assert get_preset("qwen3-vl-4b").llm.tie_embeddings
    assert not get_preset("qwen3-vl-8b").llm.tie_embeddings
