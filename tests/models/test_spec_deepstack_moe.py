"""The spec fields of Qwen3-VL (interpolated position table, DeepStack, interleaved M-RoPE) and
of mixture-of-experts LLMs: what they accept, what they refuse (naming the field), and the
parameter counts the planner prices, against hand counts."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.models.spec import LanguageSpec, ModelSpec, SpecError

LLM = {"num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4,
       "vocab_size": 100, "kv_channels": 32}  # fmt: skip


def _native(**vit: object) -> ModelSpec:
    base = get_preset("qwen2.5-vl-7b")
    return dataclasses.replace(base, vit=dataclasses.replace(base.vit, **vit))


def test_deepstack_and_table_are_priced() -> None:
    base = get_preset("qwen2.5-vl-7b")
    spec = _native(num_position_embeddings=2304, deepstack_indexes=(8, 16, 24))
    v, i, m, o = spec.vit, spec.projector_in, spec.projector_hidden, spec.llm.hidden_size
    assert spec.patch_embed_params - base.patch_embed_params == 2304 * v.hidden_size
    merger = i * m + m * o + m + o + 2 * i  # LayerNorm over the folded group, then the MLP
    assert spec.deepstack_merger_params == 3 * merger
    assert spec.vit.position_table_side == 48


@pytest.mark.parametrize(("vit", "field"), [
    ({"num_position_embeddings": 2300}, "num_position_embeddings"),
    ({"deepstack_indexes": (8, 40)}, "deepstack_indexes"),
    ({"deepstack_indexes": (8, 8)}, "deepstack_indexes"),
])  # fmt: skip
def test_bad_vision_fields_are_named(vit: dict, field: str) -> None:
    with pytest.raises(SpecError, match=f"model_spec.vit.{field}"):
        _native(**vit)


def test_deepstack_on_a_tiled_tower_is_refused() -> None:
    base = get_preset("internvl3-8b")
    with pytest.raises(SpecError, match="deepstack_indexes"):
        dataclasses.replace(base.vit, deepstack_indexes=(1,))


@pytest.mark.parametrize(("llm", "field"), [
    ({"mrope_interleaved": True}, "mrope_interleaved"),
    ({"mrope_interleaved": True, "mrope_section": (4, 6, 6)}, "mrope_interleaved"),
    ({"num_experts": 8, "moe_top_k": 9, "moe_ffn_hidden_size": 32}, "moe_top_k"),
    ({"num_experts": 8, "moe_top_k": 2}, "moe_ffn_hidden_size"),
    ({"moe_top_k": 2}, "num_experts"),
    ({"num_experts": 8, "moe_top_k": 2, "moe_ffn_hidden_size": 32, "moe_aux_loss_coeff": -1.0},
     "moe_aux_loss_coeff"),
])  # fmt: skip
def test_bad_language_fields_are_named(llm: dict, field: str) -> None:
    with pytest.raises(SpecError, match=f"model_spec.llm.{field}"):
        LanguageSpec(**LLM, **llm)


def test_interleaved_sections_that_fit_are_accepted() -> None:
    assert LanguageSpec(**LLM, mrope_section=(6, 5, 5), mrope_interleaved=True).mrope_interleaved


def test_moe_layer_counts_every_expert_and_the_router() -> None:
    dense = LanguageSpec(**LLM)
    moe = LanguageSpec(**LLM, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32)
    assert moe.expert_params == 3 * 64 * 32
    mlp_dense, mlp_moe = 3 * 64 * 128, 8 * 3 * 64 * 32 + 64 * 8
    assert moe.layer_params - dense.layer_params == mlp_moe - mlp_dense


def test_moe_fields_round_trip_through_json() -> None:
    base = get_preset("qwen2.5-vl-7b")
    llm = dataclasses.replace(base.llm, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=32,
                              mrope_section=(24, 20, 20), mrope_interleaved=True)  # fmt: skip
    vit = dataclasses.replace(base.vit, num_position_embeddings=64, deepstack_indexes=(3, 1))
    spec = dataclasses.replace(base, llm=llm, vit=vit)
    assert ModelSpec.from_dict(spec.to_dict()) == spec
