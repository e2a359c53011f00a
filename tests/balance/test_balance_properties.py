"""Property tests: any mix, any budgets and layout -> every sample exactly once, every pack within
its budgets (only a 'solo' oversize sample may exceed them, alone), a full grid of steps.

Checked with plain loops over the plan, not with the balancer's own check. Inputs include
adversarial mixes: many one-tile text-only samples whose tokens nearly fill a pack (the mix
that made the default algorithm go over the tile budget), samples exactly at the budgets, and
a few huge ones.
"""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_omnibal.balance.balancer import balance
from megatron_omnibal.balance.budgets import auto_budget
from megatron_omnibal.balance.config import BalanceConfig, Level, PackCost
from megatron_omnibal.balance.mixes import long_tail_mix
from megatron_omnibal.data.lengths import from_arrays

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def loop_check(plan, lengths, config):
    """Plain-loop oracle of the plan invariants."""
    seen = [0] * len(lengths)
    for i in list(plan.samples) + list(plan.skipped):
        seen[int(i)] += 1
    assert all(c == 1 for c in seen), "a sample is lost or duplicated"
    levels = config.all_levels
    grid = {}
    for p in range(plan.num_packs):
        lv = levels[int(plan.pack_level[p])]
        members = [int(i) for i in plan.pack(p)]
        tiles = sum(int(lengths.vit[i]) for i in members)
        tokens = sum(int(lengths.tokens[i]) for i in members)
        if tiles > lv.vit_budget or tokens > lv.token_budget:
            assert config.oversize == "solo" and len(members) == 1, (p, tiles, tokens)
            i = members[0]
            assert lengths.vit[i] > config.vit_budget or lengths.tokens[i] > config.token_budget
        step = int(plan.pack_step[p])
        grid.setdefault(step, set()).add((int(plan.pack_rank[p]), int(plan.pack_micro[p]),
                                          int(plan.pack_level[p])))
    for step, slots in grid.items():
        level = {lv for _, _, lv in slots}
        assert len(level) == 1, f"step {step} mixes levels"
        m = levels[level.pop()].micro_batches
        assert slots == {(r, k, next(iter({lv for _, _, lv in slots})))
                         for r in range(config.dp_size) for k in range(m)}
    assert sorted(grid) == list(range(plan.num_steps))


@st.composite
def mixes(draw):
    n = draw(st.integers(1, 600))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["random", "text-heavy", "at-budget", "video"]))
    vb = draw(st.integers(1, 30))
    tb = draw(st.integers(600, 9000))
    if kind == "random":
        vit = rng.integers(0, vb + 1, n)
        tokens = rng.integers(1, tb // 2 + 2, n) + 0 * vit
    elif kind == "text-heavy":  # one dummy tile, tokens close to a pack's share
        vit = np.where(rng.random(n) < 0.8, 1, rng.integers(1, vb + 1, n))
        tokens = rng.integers(tb // 6, tb // 2, n)
    elif kind == "at-budget":
        vit = rng.choice([1, vb], n)
        tokens = rng.choice([1, tb, tb // 2, tb // 2 + 1], n)
    else:
        vit = rng.integers(1, 40, n)
        tokens = vit * 200 + rng.integers(1, 3000, n)
    over = (vit > vb) | (tokens > tb)
    oversize = draw(st.sampled_from(["solo", "skip"])) if over.any() else "error"
    config = BalanceConfig(
        dp_size=draw(st.integers(1, 40)), micro_batches=draw(st.integers(1, 4)),
        vit_budget=vb, token_budget=tb, seed=draw(st.integers(0, 1000)),
        mode=draw(st.sampled_from(["random", "grouped"])),
        algorithm=draw(st.sampled_from(["default", "default", "isf"])), oversize=oversize,
        cost=draw(st.sampled_from([None, PackCost.parse("0.5,1,0.0002")])))
    return from_arrays(vit, np.maximum(tokens, 1)), config


@SETTINGS
@given(mixes())
def test_any_mix_keeps_budgets_and_every_sample(case):
    lengths, config = case
    loop_check(balance(lengths, config), lengths, config)


@SETTINGS
@given(mixes(), st.integers(2, 3), st.integers(0, 5))
def test_levels_keep_budgets_and_steps_of_one_level(case, count, curriculum):
    lengths, base = case
    tb, vb = base.token_budget, base.vit_budget
    levels = tuple(Level(vit_budget=max(vb * (k + 1) // count, 0 if vb == 0 else 1),
                         token_budget=tb * (k + 1) // count, micro_batches=count - k)
                   for k in range(count))
    levels = tuple(lv for i, lv in enumerate(levels)
                   if i == count - 1 or lv.token_budget < levels[i + 1].token_budget)
    config = BalanceConfig(**{**base.__dict__, "levels": levels,
                              "micro_batches": levels[-1].micro_batches,
                              "vit_budget": levels[-1].vit_budget,
                              "curriculum_steps": curriculum})
    plan = balance(lengths, config)
    loop_check(plan, lengths, config)
    first = plan.step_levels()[:curriculum]
    shortest = int(plan.step_levels().min()) if plan.num_steps else 0
    if shortest == 0:  # the curriculum opens with the first level's steps
        n0 = int(np.sum(plan.step_levels() == 0))
        assert (first[:min(curriculum, n0)] == 0).all()


def test_long_tail_mix_at_auto_budget_and_below():
    """The issue's cases: --auto-budget, and budget 18 tiles with --oversize solo|skip."""
    mix = long_tail_mix(20_000, seed=1, long_share=0.0, max_frames=16)
    vb, tb = auto_budget(mix)
    for config in (BalanceConfig(dp_size=32, vit_budget=vb, token_budget=tb),
                   BalanceConfig(dp_size=32, vit_budget=18, token_budget=6016, oversize="solo"),
                   BalanceConfig(dp_size=32, vit_budget=18, token_budget=6016, oversize="skip")):
        loop_check(balance(mix, config), mix, config)
