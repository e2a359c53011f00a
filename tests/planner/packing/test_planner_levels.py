"""planner/packing/pack_cost.py and planner/packing/levels.py against the planner's own pieces as
oracles: the cost model evaluated directly, brute-force recompute, the simulator step by step."""

import numpy as np
import pytest

from megatron_omnibal.balance.balancer import balance
from megatron_omnibal.balance.config import BalanceConfig, Level
from megatron_omnibal.balance.mixes import long_tail_mix
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.costs import analytic_costs, workload_features
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.cost_model.memory import inflight_1f1b
from megatron_omnibal.planner.packing import levels as hbp
from megatron_omnibal.planner.packing.pack_cost import pack_cost
from megatron_omnibal.planner.search.recompute import cheapest_recompute
from megatron_omnibal.planner.simulator.simulate import simulate

MODEL, HW = get_preset("internvl-6b-20b"), get_hardware("A100-80G")
CM = analytic_costs(MODEL, HW, 1, 8)
BOUNDS = (0, 36, 58, 76, 94)


def test_pack_cost_is_the_cost_model_per_stage():
    recompute = [{0: 30}, {0: 9, 1: 5}, {1: 10}, {1: 0}]
    cost = pack_cost(CM, BOUNDS, recompute)
    f = workload_features([7.0], [3000.0], [4.1e6])[0]
    at = CM.at(f)
    for s, (lo, hi) in enumerate(zip(BOUNDS[:-1], BOUNDS[1:], strict=True)):
        want = at.forward_ms[lo:hi].sum() + at.backward_ms[lo:hi].sum()
        for g, k in recompute[s].items():
            want += at.recompute_ms[lo:hi][np.flatnonzero(at.group[lo:hi] == g)[:k]].sum()
        want += (at.first.forward_ms + at.first.backward_ms) if lo == 0 else 0
        want += (at.last.forward_ms + at.last.backward_ms) if hi == BOUNDS[-1] else 0
        const = (CM.forward[lo:hi, 3].sum() + CM.backward[lo:hi, 3].sum() +
                 sum(CM.recompute[lo + np.flatnonzero(CM.group[lo:hi] == g)[:k], 3].sum()
                     for g, k in recompute[s].items()) +
                 ((CM.first[0, 3] + CM.first[1, 3]) if lo == 0 else 0) +
                 ((CM.last[0, 3] + CM.last[1, 3]) if hi == BOUNDS[-1] else 0))
        got = cost.stage_ms([7.0], [3000.0], [4.1e6])[s][0]
        assert got == pytest.approx(want - const, rel=1e-9)
    with pytest.raises(ValueError, match="bounds"):
        pack_cost(CM, (0, 50, 40, 94))


def test_level_recompute_is_the_cheapest_that_fits():
    pipe = hbp.Pipeline(CM, BOUNDS, 8, (HW.memory_gib - HW.reserve_gib) * 1024, 25.0)
    for vb, tb, m in ((8, 4096, 16), (32, 16384, 4)):
        got = hbp.level_recompute(pipe, vb, tb, m)
        costs = CM.at(workload_features([vb], [tb], [float(tb) ** 2])[0])
        for s, (lo, hi) in enumerate(zip(BOUNDS[:-1], BOUNDS[1:], strict=True)):
            best = cheapest_recompute(costs, lo, hi, inflight_1f1b(s, 4, m), pipe.memory_mib)
            assert best is not None and got[s] == best[0]


def test_simulate_epoch_is_the_simulator_over_every_step():
    mix = long_tail_mix(600, seed=4, long_share=0.05, long_tokens=8000, max_frames=16)
    pipe = hbp.Pipeline(CM, BOUNDS, 2, (HW.memory_gib - HW.reserve_gib) * 1024, 25.0)
    top = Level(vit_budget=32, token_budget=8192, micro_batches=2)
    levels = (Level(vit_budget=12, token_budget=4096, micro_batches=4), top)
    levels = tuple(hbp.with_recompute(lv, hbp.level_recompute(pipe, lv.vit_budget,
                                                               lv.token_budget,
                                                               lv.micro_batches))
                   for lv in levels)
    plan = balance(mix, BalanceConfig(dp_size=2, micro_batches=2, vit_budget=32,
                                      token_budget=8192, levels=levels))
    epoch = hbp.simulate_epoch(pipe, plan, mix, levels)
    total = 0.0
    for s in range(plan.num_steps):
        lv = levels[int(plan.step_levels()[s])]
        rec = [{0: v, 1: t} for v, t in zip(lv.vit_recompute, lv.llm_recompute, strict=True)]
        worst = 0.0
        for r in range(2):
            packs = [p for p in range(plan.num_packs)
                     if plan.pack_step[p] == s and plan.pack_rank[p] == r]
            feats = workload_features(
                [lengths_sum(mix.vit, plan.pack(p)) for p in packs],
                [lengths_sum(mix.tokens, plan.pack(p)) for p in packs],
                [lengths_sum(mix.tokens.astype(float) ** 2, plan.pack(p)) for p in packs])
            f, b, p2p = hbp.stage_times(pipe, feats, rec)
            worst = max(worst, simulate(f, b, 4, 1, p2p, keep_ops=False).makespan_ms)
        total += worst
    assert epoch.total_ms == pytest.approx(total)
    assert sum(p["steps"] for p in epoch.per_level) == plan.num_steps
    assert sum(p["samples"] for p in epoch.per_level) == len(mix)


def lengths_sum(values, members):
    return float(np.asarray(values, float)[members].sum())


def test_choose_levels_ends_with_the_top_and_fits():
    mix = long_tail_mix(4000, seed=1, long_share=0.02, long_tokens=16384)
    pipe = hbp.Pipeline(CM, BOUNDS, 8, (HW.memory_gib - HW.reserve_gib) * 1024, 25.0)
    top = Level(vit_budget=32, token_budget=16384, micro_batches=4)
    levels = hbp.choose_levels(pipe, mix, top)
    assert (levels[-1].vit_budget, levels[-1].token_budget) == (32, 16384)
    for lv in levels:
        assert len(lv.vit_recompute) == 4 and len(lv.llm_recompute) == 4
        assert lv.micro_batches * lv.token_budget == 4 * 16384
    BalanceConfig(dp_size=8, micro_batches=4, vit_budget=32, token_budget=16384, levels=levels)


def test_levels_leave_no_pack_empty():
    """Short levels are token-bound (text-only and small images): packed by tokens into whole
    steps, no pack is left empty while the level has samples for it (issue 11 counted hundreds at
    the shortest level); every pack keeps its level's budgets (balance checks the plan)."""
    mix = long_tail_mix(6000, seed=3, long_share=0.03, long_tokens=8000, max_frames=24)
    levels = (Level(vit_budget=10, token_budget=2048, micro_batches=16),
              Level(vit_budget=24, token_budget=4096, micro_batches=8),
              Level(vit_budget=32, token_budget=8192, micro_batches=4))
    plan = balance(mix, BalanceConfig(dp_size=4, micro_batches=4, vit_budget=32,
                                      token_budget=8192, levels=levels, oversize="skip"))
    sizes = np.diff(plan.pack_ptr)
    for lv in range(len(levels)):
        mine = plan.pack_level == lv
        assert mine.any()
        assert np.count_nonzero(sizes[mine] == 0) == max(0, mine.sum() - sizes[mine].sum())
