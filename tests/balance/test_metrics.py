"""Balance metrics against plain loops over a random plan (the oracle), and the baseline."""

import numpy as np
import pytest

from megatron_omnibal.balance import metrics
from megatron_omnibal.balance.config import PackCost
from megatron_omnibal.balance.plan_io import BalancePlan
from megatron_omnibal.data.lengths import from_arrays


def _random_plan(seed, dp=3, micro=2, steps=5, n=90):
    rng = np.random.default_rng(seed)
    lengths = from_arrays(rng.integers(0, 6, n), rng.integers(10, 900, n),
                          dataset=rng.integers(0, 3, n), names=("a", "b", "c"))
    packs = steps * dp * micro
    cuts = np.sort(rng.choice(np.arange(1, n), packs - 1, replace=False))
    ptr = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    slot = np.arange(packs)
    plan = BalancePlan(rng.permutation(n).astype(np.int64), ptr, slot // (dp * micro),
                       (slot // micro) % dp, slot % micro, np.zeros(0, np.int64),
                       {"dp": dp, "micro_batches": micro})
    plan.check(n)
    return plan, lengths


def _loops(plan, lengths, cost):
    dp = plan.meta["dp"]
    loads = {k: np.zeros((plan.num_steps, dp)) for k in ("tiles", "tokens", "time")}
    for p in range(plan.num_packs):
        s, r = plan.pack_step[p], plan.pack_rank[p]
        for i in plan.pack(p):
            v, t = float(lengths.vit[i]), float(lengths.tokens[i])
            loads["tiles"][s, r] += v
            loads["tokens"][s, r] += t
            loads["time"][s, r] += sum(a * v + b * t + c * t * t for a, b, c in zip(
                cost.tile_ms, cost.token_ms, cost.attention_ms, strict=True))
    return loads


@pytest.mark.parametrize("seed", range(4))
def test_loads_and_ratios_match_loops(seed):
    plan, lengths = _random_plan(seed)
    cost = PackCost(tile_ms=(2.0, 0.5), token_ms=(1.0, 0.0), attention_ms=(0.0, 0.01))
    got = metrics.step_loads(plan, lengths, cost)
    want = _loops(plan, lengths, cost)
    for name in ("tiles", "tokens", "time"):
        assert np.allclose(getattr(got, name), want[name])
        for s in range(plan.num_steps):
            row = want[name][s]
            mx = row.max()
            assert metrics.max_over_mean(want[name])[s] == pytest.approx(mx / row.mean())
            assert metrics.dist_ratio(want[name])[s] == pytest.approx(
                sum(mx - x for x in row) / (len(row) * mx))


def test_dist_ratio_hand_example():
    load = np.array([[4.0, 2.0, 2.0, 0.0]])
    assert metrics.dist_ratio(load)[0] == pytest.approx((0 + 2 + 2 + 4) / (4 * 4))
    assert metrics.max_over_mean(load)[0] == pytest.approx(2.0)
    assert metrics.max_over_mean(np.zeros((1, 3)))[0] == 1.0


def test_pad_ratio_matches_loops():
    plan, lengths = _random_plan(7)
    pad = slots = 0
    for p in range(plan.num_packs):
        tok = lengths.tokens[plan.pack(p)]
        pad += (tok.max() - tok).sum()
        slots += tok.max() * len(tok)
    assert metrics.pad_ratio(plan, lengths, packed=False) == pytest.approx(pad / slots)
    assert metrics.pad_ratio(plan, lengths, packed=True) == 0.0


def test_mix_skew_matches_loops():
    plan, lengths = _random_plan(3)
    trained = lengths.dataset[plan.samples]
    p = np.bincount(trained, minlength=3) / len(trained)
    got = metrics.step_mix_skew(plan, lengths)
    for s in range(plan.num_steps):
        ds = [lengths.dataset[i] for pk in np.flatnonzero(plan.pack_step == s)
              for i in plan.pack(pk)]
        q = np.bincount(ds, minlength=3) / len(ds)
        assert got[s] == pytest.approx(0.5 * np.abs(q - p).sum())
    base = metrics.shuffle_mix_skew(plan, lengths)
    assert base.shape == (plan.num_steps,) and (base >= 0).all() and (base <= 1).all()


def test_random_batching_layout():
    lengths = from_arrays(np.ones(103, np.int64), np.arange(1, 104))
    plan = metrics.random_batching(lengths, dp_size=4, micro_batches=2, samples_per_micro=3)
    assert plan.num_packs == 4 * 8 and plan.num_steps == 4  # 103 // 24 = 4 whole steps
    assert len(plan.samples) == 96 and len(plan.skipped) == 7
    assert sorted(np.concatenate([plan.samples, plan.skipped]).tolist()) == list(range(103))
    assert (np.diff(plan.pack_ptr) == 3).all()
    slots = (plan.pack_step * 4 + plan.pack_rank) * 2 + plan.pack_micro
    assert slots.tolist() == list(range(32))


def test_summarize_keys_and_balanced_case():
    # Every rank carries exactly the same work: perfect balance, no padding.
    lengths = from_arrays(np.full(16, 2), np.full(16, 100))
    plan = metrics.random_batching(lengths, dp_size=4, micro_batches=1, samples_per_micro=2)
    out = metrics.summarize(plan, lengths)
    assert out["tiles_max_mean"] == 1.0 and out["tokens_max_mean"] == 1.0
    assert out["tokens_dist_ratio"] == 0.0 and out["pad_ratio"] == 0.0
    assert out["steps"] == 2 and out["samples_per_step"] == 8
