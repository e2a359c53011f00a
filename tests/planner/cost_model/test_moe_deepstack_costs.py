"""The mixture-of-experts and DeepStack terms of the cost model against small hand computations,
and Qwen3-VL's full attention against the exact per-image count."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.models.spec import LanguageSpec, ModelSpec, ProjectorSpec, VisionSpec
from megatron_omnibal.planner.cost_model.costs import MIB, analytic_costs, workload_features
from megatron_omnibal.planner.cost_model.flops import ModelFlops, vit_layer_flops
from megatron_omnibal.planner.cost_model.hardware import Hardware
from megatron_omnibal.planner.cost_model.memory import stage_memory_mib

HW = Hardware("probe", 100.0, 80.0, 300.0, 25.0, gpus_per_node=4, op_overhead_ms=0.0)
FLOPS_PER_MS = 100e12 * 0.5 / 1e3  # peak x efficiency, one GPU


def moe_model(**llm) -> ModelSpec:
    """The tiny preset with an LLM of 8 experts of width 16, top-2, 3 layers of 32."""
    fields = dict(num_layers=3, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, vocab_size=128, num_experts=8, moe_top_k=2,
                  moe_ffn_hidden_size=16)  # fmt: skip
    fields.update(llm)
    return replace(get_preset("tiny"), llm=LanguageSpec(**fields))


def deepstack_model() -> ModelSpec:
    """A native-resolution tower of 4 layers (32 wide, tiles of 2x2 patches of 8 px) tapped
    after layers 1 and 2, into an LLM of 3 layers of 48."""
    vit = VisionSpec(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                     image_size=16, patch_size=8, class_token=False, native_resolution=True,
                     spatial_merge_size=2, temporal_patch_size=2, deepstack_indexes=(1, 2))
    llm = LanguageSpec(num_layers=3, hidden_size=48, ffn_hidden_size=96, num_attention_heads=4,
                       vocab_size=128)
    proj = ProjectorSpec(type="patch_merger", downsample=0.5, hidden_size=128,
                         merger_norm="layernorm")
    return ModelSpec(name="deep", vit=vit, projector=proj, llm=llm)


def test_moe_layer_flops_count_the_active_experts_and_the_router() -> None:
    llm = moe_model().llm
    h, q, kv = 32, 4 * 8, 2 * 8
    mlp = h * 8 + 2 * 3 * h * 16  # router + top-2 SwiGLU experts of 16
    assert ModelFlops.of(moe_model()).llm_layer_per_token == 2.0 * (2 * h * q + 2 * h * kv + mlp)
    assert llm.layer_params == 2 * h * q + 2 * h * kv + 8 * 3 * h * 16 + h * 8 + 2 * h


def test_expert_weights_and_their_optimizer_state_per_gpu_under_ep() -> None:
    """tp 2, dp 4, ep 2: attention and router over TP, Adam over DP; the 8 experts over TP x EP,
    their Adam state over the expert-data-parallel group of dp / ep = 2."""
    model = moe_model()
    llm = model.llm
    costs = analytic_costs(model, HW, tp=2, dp=4, ep=2)
    i = costs.names.index("llm.0")
    experts = 8 * 3 * 32 * 16
    dense = llm.layer_params - experts
    want = dense / 2 * (2 + 4 + 12 / 4) + experts / 4 * (2 + 4 + 12 / 2)
    assert costs.static_mib[i] * MIB == pytest.approx(want)
    assert analytic_costs(model, HW, tp=2, dp=4, ep=1).static_mib[i] * MIB == pytest.approx(
        dense / 2 * 9 + experts / 2 * 9
    )
    # the gradient sync: experts reduced over 2 ranks of dp 4 -> (1/2) / (3/4) of the DP share
    sync, _, _ = costs.sync()
    assert sync[i] * MIB == pytest.approx(9 * (dense / 2 + experts / 4 * (1 / 2) / (3 / 4)))


def test_alltoall_time_per_moe_layer_and_its_link() -> None:
    """Dispatch + combine of each token's top-2 copies (BF16, 32 wide), 1/tp of the tokens per
    rank, the (ep - 1)/ep share leaving it: over NVLink while tp x ep fits the 4-GPU node, over
    the network beyond; sent once more in the backward."""
    model = moe_model()
    i = 4 + 1  # llm.0 after 4 ViT layers and the projector
    base = analytic_costs(model, HW, tp=1, dp=8, ep=1)
    for ep, link in ((2, 300.0), (8, 25.0)):
        costs = analytic_costs(model, HW, tp=1, dp=8, ep=ep)
        a2a = 2 * 2 * 32 * 2 * (ep - 1) / ep / (link * 1e9) * 1e3
        assert costs.forward[i, 1] - base.forward[i, 1] == pytest.approx(a2a)
        assert costs.backward[i, 1] - base.backward[i, 1] == pytest.approx(a2a)
    routed = 8 + 2 * (32 + 3 * 16)  # router logits; per copy: input, fc1 (2 x 16), activation
    stored = 4 * 32 + 2 * 32 + 2 * 16 + routed
    assert base.activation[i, 1] * MIB == pytest.approx(2 * stored)


def test_ep_that_the_experts_or_dp_do_not_allow_is_refused() -> None:
    with pytest.raises(ValueError, match="expert parallel 3"):
        analytic_costs(moe_model(), HW, tp=1, dp=6, ep=3)
    with pytest.raises(ValueError, match="expert parallel 2"):
        analytic_costs(get_preset("tiny"), HW, tp=1, dp=2, ep=2)


def test_deepstack_mergers_are_priced_on_the_projector() -> None:
    model = deepstack_model()
    costs = analytic_costs(model, HW)
    p = costs.names.index("projector")
    mlp = 2.0 * (128 * 128 + 128 * 48)  # per LLM token (one per tile): 4 x 32 in, 128, 48 out
    assert costs.forward[p, 0] * FLOPS_PER_MS == pytest.approx(3 * mlp)
    one = 128 * 128 + 128 + 128 * 48 + 48
    embed = 128 * 48
    static = (one + 2 * 32) + 2 * (one + 2 * 128) + embed  # merger (LN of 32) + 2 (LN of 128)
    assert costs.static_mib[p] * MIB == pytest.approx(static * 18)


def test_deepstack_features_in_flight_cross_boundaries_and_fill_receiving_stages() -> None:
    """Units: vit.0-3 (0-3), projector (4), llm.0-2 (5-7). Tap 0 (after ViT layer 1) crosses
    the boundaries before units 2, 3, 4; tap 1 (layer 2) those before 3, 4: 4 patches x 32 wide
    x 2 bytes per tile each. Merged feature 0 crosses the boundary before llm.0 (5), merged 1
    those before 5 and 6: one token x 48 x 2 bytes per tile each."""
    model = deepstack_model()
    cm = analytic_costs(model, HW)
    tap, merged = 4 * 32 * 2 / MIB, 48 * 2 / MIB
    want = np.array([0, 0, tap, 2 * tap, 2 * tap, 2 * merged, merged, 0])
    np.testing.assert_allclose(cm.inbound[:, 0], want)
    hidden = np.array([4 * 32 * 2 / MIB] * 4 + [0, 0, 0, 0])  # ViT outputs per tile
    np.testing.assert_allclose(cm.output[:, 0], hidden + np.append(want[1:], 0))
    # the stage [3, 6) (vit.3, projector, llm.0) with 2 micro-batches in flight holds two of
    # what it receives (both taps) beside its own activations, at 10 tiles per micro-batch
    costs = cm.at(workload_features(10.0, 30.0, 300.0))
    plain = replace(costs, inbound_mib=None)
    extra = stage_memory_mib(costs, 3, 6, {}, 2) - stage_memory_mib(plain, 3, 6, {}, 2)
    assert extra == pytest.approx(2 * 10 * 2 * tap)
    assert stage_memory_mib(costs, 0, 3, {}, 2) == stage_memory_mib(plain, 0, 3, {}, 2)


def test_deepstack_taps_are_replicated_over_tp_and_merged_features_split() -> None:
    """At TP=2 a tap still carries every patch at the ViT's width on each rank (the tower runs
    replicated); a merged feature carries half the image tokens (sequence parallelism)."""
    tap, merged = 4 * 32 * 2 / MIB, 48 * 2 / MIB
    want = np.array([0, 0, tap, 2 * tap, 2 * tap, merged, merged / 2, 0])
    np.testing.assert_allclose(analytic_costs(deepstack_model(), HW, tp=2).inbound[:, 0], want)


def test_qwen3_vl_attends_over_each_whole_image_in_every_layer() -> None:
    """No windows: each ViT layer's FLOPs over one 24 x 40 patch image (240 tiles) are the exact
    full-attention count of that image, in all 27 layers."""
    spec = get_preset("qwen3-vl-8b")
    flops = ModelFlops.of(spec, np.array([240]))
    exact = vit_layer_flops(spec.vit, np.array([[1, 24, 40]]), full=False)
    assert flops.vit_layer_per_tile * 240 == pytest.approx(exact)
    assert flops.vit_full_layers == 0 and flops.vit_layers == 27


def test_the_partition_search_sees_what_stages_receive() -> None:
    """The search's per-segment memory (SegmentFrontier, everything recomputed) is the stage
    memory with the received DeepStack features, for every segment of the DeepStack model."""
    from megatron_omnibal.planner.search.recompute import SegmentFrontier

    costs = analytic_costs(deepstack_model(), HW).at(workload_features(10.0, 30.0, 300.0))
    most = SegmentFrontier(costs).min_memory_mib(3)
    units = len(costs)
    for lo in range(units):
        for hi in range(lo + 1, units + 1):
            group = np.asarray(costs.group[lo:hi])
            every = {g: int(np.sum(group == g)) for g in (0, 1) if np.any(group == g)}
            assert most[lo, hi] == pytest.approx(stage_memory_mib(costs, lo, hi, every, 3))


def test_the_baseline_screen_counts_what_stages_receive() -> None:
    """The hand-set baseline's array screen (`_Layouts.fitting_recompute`) agrees with the
    partition's own memory at the edge of the budget, for a layout whose second stage, the
    peak, receives both taps (ViT layers 0-2 on stage 0; layer 3, the projector and the LLM on
    stage 1)."""
    from megatron_omnibal.data.lengths import from_arrays
    from megatron_omnibal.planner.search.baseline import _Layouts
    from megatron_omnibal.planner.search.request import PlanRequest
    from megatron_omnibal.planner.search.setting import make_setting

    model = deepstack_model()
    rng = np.random.default_rng(0)
    tiles = rng.integers(1, 40, 64)
    request = PlanRequest(model=model, hardware=HW, gpus=2, global_batch=16,
                          lengths=from_arrays(tiles, tiles + rng.integers(8, 200, 64), tiles))
    setting = make_setting(request, 1, 2, 1, 4, balanced=False)
    bounds = (0, 3, 8)
    part = setting.problem(np.inf, setting.fixed).evaluate(bounds, [{0: 0}, {0: 0, 1: 0}])
    assert part.memory_mib[1] > part.memory_mib[0]  # the stage receiving features is the peak
    peak = float(part.memory_mib.max())
    for budget, fits in ((peak - 1e-3, False), (peak + 1e-3, True)):  # received: 0.058 MiB
        layouts = _Layouts(setting, budget, model.vit.num_layers)
        assert bool(layouts.fitting_recompute(np.array([bounds]), False, 0)[0, 0]) == fits
