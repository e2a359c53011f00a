"""Presets, cost model and per-stage memory against published and hand-computed numbers."""

import numpy as np
import pytest

from megatron_omnibal.models.presets import PRESETS, get_preset
from megatron_omnibal.planner.cost_model.costs import LayerCosts, analytic_costs, workload_features
from megatron_omnibal.planner.cost_model.hardware import HARDWARE, get_hardware
from megatron_omnibal.planner.cost_model.memory import (
    inflight_1f1b,
    inflight_interleaved,
    stage_memory_mib,
    stage_time_ms,
)


def llm_params(name):
    m = get_preset(name)
    return m.llm.num_layers * m.llm.layer_params + 2 * m.llm.vocab_size * m.llm.hidden_size


@pytest.mark.parametrize(
    "name, published",
    [
        ("internvl-6b-20b", 19.86e9),  # InternLM2-20B model card
        ("internvl-6b-34b", 34.39e9),  # Yi-34B: 34.4B
        ("llava-1.5-7b", 6.74e9),  # Llama-2-7B: 6.74B
        ("llava-1.5-13b", 13.02e9),  # Llama-2-13B: 13.0B
        ("internvl2-8b", 7.74e9),  # InternLM2.5-7B: 7.74B
        ("internvl3-8b", 7.61e9),  # Qwen2.5-7B model card: 7.61B
        ("internvl3.5-8b", 8.19e9),  # Qwen3-8B model card: 8.2B
        ("internvl3.5-38b", 32.8e9),  # Qwen3-32B model card: 32.8B
        ("llava-llama3.1-8b", 8.03e9),  # Llama-3.1-8B: 8.03B
    ],
)
def test_llm_parameter_counts_match_published(name, published):
    assert llm_params(name) == pytest.approx(published, rel=0.01)


def test_vit_parameter_counts_match_published():
    vit6 = get_preset("internvl-6b-20b")
    # InternViT-6B-448px-V1-5 model card: 5.5B (45 layers)
    assert vit6.vit.num_layers * vit6.vit.layer_params == pytest.approx(5.54e9, rel=0.02)
    clip = get_preset("llava-1.5-7b")  # CLIP ViT-L/14: 304M
    # LLaVA runs 23 of its 24 layers (vision_feature_layer -2); the checkpoint holds 24
    assert clip.vit.num_layers == 23
    assert 24 * clip.vit.layer_params == pytest.approx(304e6, rel=0.02)


def test_tokens_per_tile():
    assert get_preset("internvl-6b-20b").tokens_per_tile == 256  # (448/14)^2 / 4
    assert get_preset("llava-1.5-7b").tokens_per_tile == 576  # (336/14)^2
    assert get_preset("internvl-6b-20b").projector_in == 12800


def test_unknown_presets_are_clear_errors():
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'.*internvl-6b-20b"):
        get_preset("gpt5")
    with pytest.raises(ValueError, match="unknown hardware preset 'V100'.*A100-80G"):
        get_hardware("V100")
    assert {"A100-40G", "A100-80G", "H100-80G", "H200"} <= set(HARDWARE)
    assert "tiny" in PRESETS


def test_llm_time_follows_flops_and_gqa():
    model, hw = get_preset("internvl-6b-20b"), get_hardware("A100-80G")
    cm = analytic_costs(model, hw)
    llm = model.llm
    h, kv = llm.hidden_size, llm.kv_size
    flops_per_token = 2 * (2 * h * h + 2 * h * kv + 3 * h * llm.ffn_hidden_size)
    rate = hw.peak_tflops * 1e12 * hw.efficiency / 1e3
    unit = model.vit.num_layers + 1
    tokens = workload_features(0, 1000, 0)
    base = workload_features(0, 0, 0)
    got = cm.at(tokens).forward_ms[unit] - cm.at(base).forward_ms[unit]
    assert got == pytest.approx(1000 * flops_per_token / rate)
    # packed sequences: causal attention costs 2 h L^2 FLOPs per sequence, summed
    one_long = cm.at(workload_features(0, 4096, 4096**2)).forward_ms[unit]
    four_short = cm.at(workload_features(0, 4096, 4 * 1024**2)).forward_ms[unit]
    assert one_long - four_short == pytest.approx(2 * h * (4096**2 - 4 * 1024**2) / rate)
    assert cm.backward[unit] == pytest.approx(2 * cm.forward[unit])


def test_llm_time_follows_the_head_size_not_the_width():
    """Qwen3-32B: 64 heads of 128 project 5120 to 8192; q, output projection and attention
    scores are priced at that width."""
    model, hw = get_preset("internvl3.5-38b"), get_hardware("A100-80G")
    cm = analytic_costs(model, hw)
    llm = model.llm
    h, q, kv = llm.hidden_size, llm.q_size, llm.kv_size
    assert (h, q) == (5120, 8192)
    flops_per_token = 2 * (2 * h * q + 2 * h * kv + 3 * h * llm.ffn_hidden_size)
    rate = hw.peak_tflops * 1e12 * hw.efficiency / 1e3
    unit = model.vit.num_layers + 1
    base = cm.at(workload_features(0, 0, 0)).forward_ms[unit]
    got = cm.at(workload_features(0, 1000, 0)).forward_ms[unit] - base
    assert got == pytest.approx(1000 * flops_per_token / rate)
    scores = cm.at(workload_features(0, 0, 1000**2)).forward_ms[unit] - base
    assert scores == pytest.approx(2 * q * 1000**2 / rate)
    # Activations: 4 h-wide tensors, q and the attention context at q, k and v, the gated MLP's
    # 3 f; bf16, so 2 bytes each per token.
    stored = 4 * h + 2 * q + 2 * kv + 3 * llm.ffn_hidden_size
    activation = cm.at(workload_features(0, 1000, 0)).activation_mib[unit]
    assert activation == pytest.approx(1000 * 2 * stored / 2**20)


def test_static_memory_distributed_optimizer():
    model, hw = get_preset("llava-1.5-7b"), get_hardware("A100-80G")
    unit = model.vit.num_layers + 1
    for dp in (1, 8):
        cm = analytic_costs(model, hw, tp=2, dp=dp)
        want = model.llm.layer_params / 2 * (2 + 4 + 12 / dp) / 2**20
        assert cm.static_mib[unit] == pytest.approx(want)


def test_inflight_counts():
    assert [inflight_1f1b(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [inflight_1f1b(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    # Megatron interleaved warm-up: (pp - r - 1) * 2 + (vpp - 1) * pp, plus one
    assert [inflight_interleaved(r, 4, 2, 8) for r in range(4)] == [11, 9, 7, 5]
    assert inflight_interleaved(0, 4, 1, 8) == 4


def test_stage_memory_and_time_by_hand():
    costs = LayerCosts(
        ("a", "b", "c"),
        np.array([1.0, 2.0, 3.0]),
        np.array([2.0, 4.0, 6.0]),
        np.array([1.0, 2.0, 3.0]),
        np.array([100.0, 200.0, 300.0]),
        np.array([10.0, 20.0, 30.0]),
        np.zeros(3),
        np.array([50.0, 60.0, 70.0]),
        np.array([0, 0, 1]),
    )
    # stage [0, 2) with its first group-0 layer recomputed, 3 micro-batches in flight:
    # static 110 + 3 x (10 + 200)
    assert stage_memory_mib(costs, 0, 2, {0: 1}, 3) == 110 + 3 * 210
    assert stage_time_ms(costs, 0, 2, {0: 1}) == (3.0, 6.0 + 1.0)
    assert stage_memory_mib(costs, 1, 3, {0: 1, 1: 1}, 1) == 130 + 20 + 30
    with pytest.raises(ValueError, match="cannot recompute 2 layers"):
        stage_memory_mib(costs, 2, 3, {1: 2}, 1)


def test_profile_cost_model_scales_measured_numbers():
    """Oracle: an analytic model exported as a profile at one batch, read back at another."""
    from dataclasses import replace

    from megatron_omnibal.planner.cost_model.costs import costs_to_profile, profile_cost_model

    hw = replace(get_hardware("A100-80G"), op_overhead_ms=0.0)
    cm = analytic_costs(get_preset("tiny"), hw)
    doc = costs_to_profile(cm.at(workload_features(4, 256, 0)), 8)
    doc["measured"] = {"tiles": 4, "tokens": 256}
    got = profile_cost_model(doc).at(workload_features(12, 768, 0))
    want = cm.at(workload_features(12, 768, 0))
    want_total = want.forward_ms.sum() + want.first.forward_ms + want.last.forward_ms
    assert got.forward_ms.sum() == pytest.approx(want_total)
    assert got.checkpoint_mib[6] == pytest.approx(want.checkpoint_mib[6])
    del doc["measured"]
    with pytest.raises(ValueError, match="needs 'measured'"):
        profile_cost_model(doc)
