"""BalancedBatchSampler: all ranks together train every sample once per epoch; exact resume."""

import json

import numpy as np
import pytest

from megatron_omnibal.balance.balancer import balance
from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.balance.sampler import BalancedBatchSampler
from megatron_omnibal.data.lengths import from_arrays


@pytest.fixture(scope="module")
def lengths():
    rng = np.random.default_rng(0)
    vit = rng.integers(1, 6, 700)
    return from_arrays(vit, 256 * vit + rng.integers(40, 700, 700),
                       dataset=rng.integers(0, 2, 700), names=("a", "b"))


CONFIG = BalanceConfig(dp_size=3, micro_batches=2, vit_budget=12, token_budget=4096, seed=4)


def _take(it, k):
    return [next(it) for _ in range(k)]


def test_one_epoch_over_all_ranks_is_the_plan(lengths):
    samplers = [BalancedBatchSampler(lengths, CONFIG, dp_rank=r) for r in range(3)]
    steps = samplers[0].steps_per_epoch
    plan = balance(lengths, CONFIG)
    assert steps == plan.num_steps
    seen = []
    for r, s in enumerate(samplers):
        batches = _take(iter(s), steps * 2)
        for k, batch in enumerate(batches):
            step, micro = divmod(k, 2)
            p = np.flatnonzero((plan.pack_step == step) & (plan.pack_rank == r) &
                               (plan.pack_micro == micro))
            assert batch == plan.pack(int(p[0])).tolist()
            seen.extend(batch)
    assert sorted(seen) == list(range(len(lengths)))


def test_next_epoch_is_reshuffled_and_complete(lengths):
    s = BalancedBatchSampler(lengths, CONFIG, dp_rank=0)
    n = s.steps_per_epoch * 2
    it = iter(s)
    first = _take(it, n)
    assert (s.state_dict()["epoch"], s.state_dict()["step"], s.state_dict()["micro"]) == (1, 0, 0)
    second = _take(it, n)
    assert s.state_dict()["epoch"] == 2
    assert first != second
    s.set_epoch(1)
    assert _take(iter(s), n) == second


def test_resume_continues_exactly(lengths):
    s = BalancedBatchSampler(lengths, CONFIG, dp_rank=1)
    it = iter(s)
    _take(it, 5)
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON checkpoint
    assert state["micro"] == 1 and state["step"] == 2 and state["epoch"] == 0
    expected = _take(it, s.steps_per_epoch * 2 + 3)  # runs into the next epoch
    fresh = BalancedBatchSampler(lengths, CONFIG, dp_rank=1)
    fresh.load_state_dict(state)
    assert _take(iter(fresh), len(expected)) == expected


def test_bad_state_and_arguments(lengths):
    s = BalancedBatchSampler(lengths, CONFIG, dp_rank=0)
    with pytest.raises(ValueError, match="dp_size"):
        s.load_state_dict({"epoch": 0, "step": 0, "micro": 0, "dp_size": 5})
    with pytest.raises(ValueError, match="bad position"):
        s.load_state_dict({"epoch": 0, "step": 0, "micro": 7})
    with pytest.raises(ValueError, match="dp_rank"):
        BalancedBatchSampler(lengths, CONFIG, dp_rank=3)


def test_samplers_of_one_process_balance_an_epoch_once(monkeypatch):
    """The training log's sampler and a rank's iterator sampler ask for the same epoch at
    start-up: one balance() between them, the same (read-only) plan; another epoch, config or
    lengths object is balanced anew."""
    from megatron_omnibal.balance import sampler as sampler_module

    calls = []
    real = sampler_module.balance
    monkeypatch.setattr(sampler_module, "balance",
                        lambda lengths, config: calls.append(config.seed) or real(lengths, config))
    monkeypatch.setattr(sampler_module, "_recent", [])
    lengths = from_arrays(np.ones(64, np.int64), np.arange(64) + 10)
    config = BalanceConfig(dp_size=2, vit_budget=4, token_budget=400, seed=3)
    log_side = BalancedBatchSampler(lengths, config, dp_rank=0)
    rank_side = BalancedBatchSampler(lengths, config, dp_rank=1)
    assert log_side.plan(0) is rank_side.plan(0) and calls == [3]
    with pytest.raises(ValueError, match="read-only"):
        log_side.plan(0).samples[0] = 1
    log_side.plan(1)
    BalancedBatchSampler(from_arrays(lengths.vit, lengths.tokens), config, dp_rank=0)
    assert calls == [3, 4, 3]
