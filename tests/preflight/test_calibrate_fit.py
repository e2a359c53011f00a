"""`--calibrate`'s fits (preflight/fit.py, preflight/calibrate.py) against known coefficients:
a synthetic preflight report whose micro-batch times are made from chosen per-tile, per-token,
per-squared-length and fixed costs and a chosen point-to-point time must give a profile from
which the planner's cost model (`omnibal plan --profile`) reads exactly those back.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.costs import profile_cost_model, workload_features
from megatron_omnibal.planner.simulator.simulate import simulate
from megatron_omnibal.preflight.calibrate import calibrated_profile
from megatron_omnibal.preflight.fit import (
    fit_p2p_ms,
    nonnegative_least_squares,
    supported_fit,
)


def test_nonnegative_least_squares_recovers_and_clamps() -> None:
    rng = np.random.default_rng(0)
    x = np.stack([rng.uniform(1, 16, 20), rng.uniform(1e3, 1e5, 20), np.ones(20)], axis=1)
    want = np.array([0.5, 2e-4, 3.0])
    np.testing.assert_allclose(nonnegative_least_squares(x, x @ want), want, rtol=1e-9)
    # y falls with the first column: its coefficient is clamped at 0, the rest refitted
    y = 10.0 - 0.3 * x[:, 0]
    got = nonnegative_least_squares(x, y)
    assert got[0] == 0 and np.all(got >= 0)
    best = np.linalg.lstsq(x[:, 1:], y, rcond=None)[0]
    if np.all(best >= 0):
        np.testing.assert_allclose(got[1:], best, rtol=1e-9)


def test_supported_fit_keeps_the_terms_the_data_hold() -> None:
    rng = np.random.default_rng(5)
    tokens = rng.uniform(300, 330, 16)  # balanced: sizes close together
    x = np.stack([tokens, tokens**2, np.ones(16)], axis=1)
    # exact times: exactly the terms they were made of, and no other
    np.testing.assert_allclose(supported_fit(x, x @ [0.1, 0.0, 4.0]), [0.1, 0, 4.0], rtol=1e-6)
    np.testing.assert_allclose(supported_fit(x, x @ [0.1, 2e-4, 0.0]), [0.1, 2e-4, 0],
                               rtol=1e-6)  # fmt: skip
    # proportional times with 5% noise: a fixed part fitted to the noise is not kept
    y = 0.1 * tokens * rng.normal(1.0, 0.05, 16)
    got = supported_fit(x, y)
    assert got[2] == 0 and nonnegative_least_squares(x, y)[2] > 0
    # the attention term, fitted always beside the per-token one, the fixed part where held
    noisy = x @ [0.1, 2e-4, 0.0] * rng.normal(1.0, 0.05, 16)
    got = supported_fit(x, noisy, always=2)
    assert got[2] == 0 and got[0] + got[1] > 0
    np.testing.assert_allclose(supported_fit(x, x @ [0.1, 2e-4, 4.0], always=2), [0.1, 2e-4, 4.0],
                               rtol=1e-6)  # fmt: skip
    # times that do not grow with these close sizes: they still grow per token, never all fixed
    y = rng.normal(30.0, 3.0, 16)
    got = supported_fit(x, y)
    assert got[0] > 0 and got[0] * tokens.mean() + got[1] * (tokens**2).mean() + got[2] == (
        pytest.approx(y.mean(), rel=0.05))  # fmt: skip


def test_p2p_fit_by_hand_and_through_the_simulator() -> None:
    # PP=2, one micro-batch: F0, send, F1, B1, send back, B0 in a row: 1 + 2 + 3 + 4 + 2 p
    forward, backward = np.array([[1.0], [2.0]]), np.array([[4.0], [3.0]])
    assert fit_p2p_ms(forward, backward, 10.0 + 2 * 0.35) == pytest.approx(0.35, rel=1e-6)
    assert fit_p2p_ms(forward, backward, 9.0) == 0.0  # the passes alone span more
    rng = np.random.default_rng(1)
    forward, backward = rng.uniform(1, 5, (3, 6)), rng.uniform(2, 9, (3, 6))
    span = simulate(forward, backward, 3, 1, 0.8).makespan_ms
    assert fit_p2p_ms(forward, backward, span) == pytest.approx(0.8, rel=1e-6)


# stage 0: ViT 0-3, projector, LLM 0; stage 1: LLM 1-3 and the head
LAYOUTS = [{"vit_layers": [0, 4], "llm_layers": [0, 1], "projector": True},
           {"vit_layers": [4, 4], "llm_layers": [1, 4], "projector": False}]  # fmt: skip
VIT = (0.4, 1.5)  # ms per tile, fixed ms, of one ViT layer
LLM = (0.01, 2e-5, 0.7)  # ms per token, per squared length, fixed, of one LLM layer
REST = [(0.2, 3.0), (0.03, 5.0)]  # stage 0 per tile + fixed; stage 1 per token + fixed
BACKWARD = [2.0, 2.5]  # backward over forward step, per stage
P2P, OVERHEAD = 1.7, 12.0


def _report(rng: np.random.Generator) -> dict:
    """Two stages, a worst step and three typical steps of 4 micro-batches, timed exactly as
    the chosen costs make them; the first stage's schedule spans what 1F1B with P2P does."""
    labels = ["worst level 0", "typical", "typical", "typical"]
    runs: list[list[dict]] = [[], []]
    for label in labels:
        if label == "typical":
            tiles = rng.integers(4, 17, 4)
            samples = [rng.integers(20, 200, rng.integers(1, 5)) for _ in range(4)]
        else:
            tiles, samples = np.full(4, 16), [np.array([400])] * 4
        tokens = np.array([s.sum() for s in samples])
        squares = np.array([(s.astype(np.int64) ** 2).sum() for s in samples])
        vit = 4 * (VIT[0] * tiles + VIT[1])
        llm_one = LLM[0] * tokens + LLM[1] * squares + LLM[2]
        calls = [vit + llm_one + REST[0][0] * tiles + REST[0][1],
                 3 * llm_one + REST[1][0] * tokens + REST[1][1]]  # fmt: skip
        towers = [{"vit": vit, "llm": llm_one}, {"llm": 3 * llm_one}]
        backward = [BACKWARD[s] * calls[s] for s in range(2)]
        span = simulate(np.array(calls), np.array(backward), 2, 1, P2P).makespan_ms
        batches = np.stack([tiles, tokens, squares], axis=1).tolist()
        for s in range(2):
            runs[s].append({"label": label, "step_ms": span + OVERHEAD, "schedule_ms": span,
                            "batches": batches, "call_ms": calls[s].tolist(),
                            "forward_ms": calls[s].tolist(), "backward_ms": backward[s].tolist(),
                            "tower_ms": {t: v.tolist() for t, v in towers[s].items()}})  # fmt: skip
    layers = [{"vit": [[0.01, 0.001, 1.0]] * 4, "llm": [[0.02, 0.002, 1.0]]},
              {"llm": [[0.02, 0.002, 1.0]] * 3}]  # fmt: skip
    return {"stages": [{"stage": s, "measured": {
        "runs": runs[s], "layers": layers[s], "activation_gib": 0.5,
        "outside_schedule_ms": OVERHEAD}} for s in range(2)]}  # fmt: skip


def test_calibration_recovers_the_costs_it_was_made_from() -> None:
    profile = calibrated_profile(report=_report(np.random.default_rng(2)),
                                 spec=get_preset("tiny"), layouts=LAYOUTS, tiles=16,
                                 tokens=400, micro_batches=4, memory_budget_gib=None)  # fmt: skip
    assert profile["p2p_ms"] == pytest.approx(P2P, rel=1e-6)
    assert profile["step_overhead_ms"] == OVERHEAD
    cm = profile_cost_model(profile)  # as `omnibal plan --profile` reads it
    assert cm.p2p_ms == pytest.approx(P2P, rel=1e-6)
    by_name = dict(zip(cm.names, range(len(cm.names)), strict=True))
    want = {f"vit.{i}": [VIT[0], 0, 0, VIT[1]] for i in range(4)}
    want["projector"] = [REST[0][0], 0, 0, REST[0][1]]  # stage 0's work outside its layers
    want |= {f"llm.{i}": [0, LLM[0], LLM[1], LLM[2]] for i in range(3)}
    want["llm.3"] = [0, LLM[0] + REST[1][0], LLM[1], LLM[2] + REST[1][1]]  # stage 1's head
    for name, row in want.items():
        u = by_name[name]
        stage = 0 if name in ("projector", "llm.0") or name.startswith("vit") else 1
        np.testing.assert_allclose(cm.forward[u], row, rtol=1e-6, atol=1e-9, err_msg=name)
        np.testing.assert_allclose(cm.backward[u], BACKWARD[stage] * np.array(row), rtol=1e-6,
                                   atol=1e-9, err_msg=name)  # fmt: skip
    # the attention term prices packs by their squared lengths: one sample of 300 tokens
    # against three of 100 differ by exactly the LLM layers' attention
    one, three = cm.at(workload_features([8, 8], [300, 300], [300**2, 3 * 100**2])).forward_ms.T
    llm = [by_name[f"llm.{i}"] for i in range(4)]
    assert (one - three)[llm] == pytest.approx([LLM[1] * (300**2 - 3 * 100**2)] * 4)


def test_the_planner_takes_a_profiles_p2p_time_for_every_transfer() -> None:
    """`omnibal plan --profile`: a profile's `p2p_ms` replaces the hardware's latency and link
    in every prediction, the plan's and Megatron's layout at its sizes."""
    from megatron_omnibal.data.lengths import from_arrays
    from megatron_omnibal.planner.cost_model.hardware import get_hardware
    from megatron_omnibal.planner.make import make_plan
    from megatron_omnibal.planner.search.request import PlanRequest
    from megatron_omnibal.planner.search.setting import make_setting

    doc = calibrated_profile(report=_report(np.random.default_rng(2)), spec=get_preset("tiny"),
                             layouts=LAYOUTS, tiles=16, tokens=400, micro_batches=4,
                             memory_budget_gib=None)  # fmt: skip
    vit = [1, 2, 3, 1] * 16
    stats = from_arrays(vit, [v * 4 + 30 for v in vit])

    def request(p2p):
        return PlanRequest(model=get_preset("tiny"), hardware=get_hardware("H100-80G"),
                           lengths=stats, gpus=2, pp=2, global_batch=32,
                           profile={**doc, "p2p_ms": p2p})  # fmt: skip

    setting = make_setting(request(40.0), 1, 2, 1, 4)
    assert setting.p2p_ms(np.full(9, 5.0)).tolist() == [40.0] * 10  # no bytes over a link
    near, far = make_plan(request(0.0)), make_plan(request(40.0))
    # 1F1B at PP=2: the first stage's last backward waits for a send there and one back
    assert far.predicted.step_ms >= near.predicted.step_ms + 2 * 40.0 - 1e-6
    assert (far.predicted.same_parallel.step_ms
            >= near.predicted.same_parallel.step_ms + 2 * 40.0 - 1e-6)  # fmt: skip


def test_a_profile_of_fixed_times_only_is_refused_naming_the_profile_and_a_layer(
        tmp_path) -> None:  # fmt: skip
    """A hand-written profile whose every layer is all `fixed_ms` prices every pack the same:
    planning from it stops with an error naming the profile and its first layer, not the
    balancer's bare PackCost error."""
    from megatron_omnibal.data.lengths import from_arrays
    from megatron_omnibal.planner.cost_model.hardware import get_hardware
    from megatron_omnibal.planner.make import make_plan
    from megatron_omnibal.planner.search.request import PlanRequest

    names = [*(f"vit.{i}" for i in range(4)), "projector", *(f"llm.{i}" for i in range(4))]
    layers = [{"name": n, "forward_ms": 2.0, "backward_ms": 4.0, "fixed_ms": 2.0,
               "activation_mib": 1.0, "weight_mib": 1.0,
               "group": "none" if n == "projector" else n[:3]} for n in names]  # fmt: skip
    doc = {"micro_batches": 2, "layers": layers, "measured": {"tiles": 8, "tokens": 128}}
    vit = [1, 2, 3, 1] * 8
    request = PlanRequest(model=get_preset("tiny"), hardware=get_hardware("H100-80G"),
                          lengths=from_arrays(vit, [v * 4 + 30 for v in vit]), gpus=2, pp=2,
                          global_batch=8, profile=doc, profile_path="hand.json")  # fmt: skip
    with pytest.raises(ValueError, match=r"hand\.json: every layer's time is its 'fixed_ms' "
                       r"\(the first, layer 0 \('vit\.0'\)"):  # fmt: skip
        make_plan(request)
    layers[5] = {**layers[5], "fixed_ms": 1.5}  # one layer that grows with tokens: plans
    assert make_plan(request).predicted.step_ms > 0


def test_spread_packs_by_hand() -> None:
    from megatron_omnibal.preflight.packs import WorstPack, spread_packs

    worst = WorstPack(level=0, tiles=17, tokens=384, micro_batches=4)
    # k/4 of 384 tokens; tiles round(17 k / 4), at most (tokens - 2) // 16
    got = [(p.tiles, p.tokens) for p in spread_packs(worst, 16)]
    assert got == [(4, 96), (8, 192), (13, 288), (17, 384)]
    small = WorstPack(level=1, tiles=3, tokens=40, micro_batches=2)
    assert [(p.tiles, p.tokens, p.level) for p in spread_packs(small, 16)] == [(1, 20, 1),
                                                                             (2, 40, 1)]


def _one_stage_report() -> dict:
    """One stage holding the tiny model (4 ViT layers, the projector, 4 LLM layers), each LLM
    layer timed as A x tokens + Q x tokens^2 (the local attention runs over the whole packed
    micro-batch: its squared length), each ViT layer 0.4 ms per tile, nothing outside the
    layers: the worst step's 4 micro-batches of 384 tokens measured 5% slow (the machine's load
    at that moment), a spread step of one sample each of 96, 192, 288 and 384 tokens, and
    three balanced steps of 313-317 tokens."""
    sizes = [[384] * 4, [96, 192, 288, 384], [316, 314, 313, 313], [315, 315, 313, 317],
             [316, 316, 313, 316]]  # fmt: skip
    labels = ["worst level 0", "spread level 0", "typical", "typical", "typical"]
    runs = []
    for label, size in zip(labels, sizes, strict=True):
        tokens = np.array(size, np.float64)
        slower = 1.05 if label.startswith("worst") else 1.0
        tiles = np.round(tokens / 24)
        vit = 4 * 0.4 * tiles * slower
        llm = 4 * (A_TOKEN * tokens + Q_SQUARE * tokens**2) * slower
        runs.append({"label": label, "step_ms": 0.0, "schedule_ms": 0.0,
                     "batches": [[int(n), int(t), int(t * t)]
                                 for n, t in zip(tiles, tokens, strict=True)],
                     "call_ms": (vit + llm).tolist(), "forward_ms": (vit + llm).tolist(),
                     "backward_ms": (2 * (vit + llm)).tolist(),
                     "tower_ms": {"vit": vit.tolist(), "llm": llm.tolist()}})  # fmt: skip
    rows = [[0.02, 0.002, 1.0]] * 4
    return {"stages": [{"stage": 0, "measured": {
        "runs": runs, "layers": {"vit": rows, "llm": rows}, "activation_gib": 0.5,
        "outside_schedule_ms": 0.0}}]}  # fmt: skip


A_TOKEN, Q_SQUARE = 0.1, 1e-4  # ms per token and per squared length of one LLM layer


def test_a_padded_micro_batch_is_priced_by_hand() -> None:
    """A padded baseline micro-batch runs past the token budget (4 samples padded to the
    longest, 158 tokens: 632 tokens, attention over 632^2). By hand, one LLM layer costs
    0.1 x 632 + 1e-4 x 632^2 = 63.2 + 39.94 = 103.14 ms forward. The fit's growth beyond the
    balanced sizes must not pivot on the worst step, one size under one moment's load: fitted
    with it (5% slow), this micro-batch was priced 19% over (16% with the spread step too).
    From the spread and balanced steps the calibrated profile prices it as by hand."""
    layout = [{"vit_layers": [0, 4], "llm_layers": [0, 4], "projector": True}]
    padded = workload_features([18], [4 * 158], [(4 * 158) ** 2])[0]
    by_hand = 0.1 * 632 + 1e-4 * 632**2
    assert by_hand == pytest.approx(103.1424)
    profile = calibrated_profile(report=_one_stage_report(), spec=get_preset("tiny"),
                                 layouts=layout, tiles=16, tokens=384, micro_batches=4,
                                 memory_budget_gib=None)  # fmt: skip
    llm = [i for i, layer in enumerate(profile["layers"]) if layer["group"] == "llm"]
    vit = [i for i, layer in enumerate(profile["layers"]) if layer["group"] == "vit"]
    cm = profile_cost_model(profile)
    assert cm.at(padded).forward_ms[llm] == pytest.approx([by_hand] * 4, rel=1e-6)
    assert cm.at(padded).backward_ms[llm] == pytest.approx([2 * by_hand] * 4, rel=1e-6)
    assert cm.at(padded).forward_ms[vit] == pytest.approx([0.4 * 18] * 4, rel=1e-6)
