"""The plan against the hand-set baseline it is compared with: the baseline's own configuration
on balanced micro-batches is a candidate (planner/make.py), so wherever the request admits that
configuration the plan is never predicted slower than the baseline."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_omnibal.data.lengths import from_arrays
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner import make
from megatron_omnibal.planner.cost_model.hardware import Hardware
from megatron_omnibal.planner.search.baseline import best_megatron_baseline
from megatron_omnibal.planner.search.request import PlanRequest


def _request(**kw) -> PlanRequest:
    """small on 8 GPUs, 32 samples per step: its best hand-set baseline is interleaved."""
    rng = np.random.default_rng(1)
    vit = rng.integers(1, 6, 300)
    hw = Hardware("probe", 100.0, 80.0, 300.0, 25.0, gpus_per_node=4, reserve_gib=0.0,
                  efficiency=0.3)  # fmt: skip
    return PlanRequest(model=get_preset("small"), hardware=hw,
                       lengths=from_arrays(vit, vit * 16 + rng.integers(8, 400, 300)), gpus=8,
                       global_batch=32, seed=1, vpp=2, mode="exact", **kw)  # fmt: skip


def test_a_search_slower_than_the_baseline_gives_way_to_its_configuration(monkeypatch) -> None:
    """Every searched candidate made 10 times slower than the baseline (as a screened search
    can miss the baseline's split on a large model): the plan is the baseline's own
    configuration with balanced micro-batches, predicted faster than the baseline."""
    request = _request()
    base = best_megatron_baseline(request).best
    assert base is not None and base.config.vpp == 2
    searched = make.plan_candidates

    def slow(*args, **kwargs):
        return [replace(e, result=replace(e.result, step_ms=10 * base.result.step_ms))
                for e in searched(*args, **kwargs)]  # fmt: skip

    monkeypatch.setattr(make, "plan_candidates", slow)
    plan = make.make_plan(request)
    own = make.baseline_on_balanced_data(request, base.config)
    assert own is not None and own.result.step_ms <= base.result.step_ms
    assert plan.predicted.step_ms == pytest.approx(own.result.step_ms, abs=1e-3)
    assert plan.predicted.speedup >= 1.0
    c, p = base.config, plan.parallel
    assert (p.tp, p.pp, p.dp, p.micro_batches, p.vpp) == (c.tp, c.pp, c.dp, c.micro_batches, 2)


def test_the_baselines_configuration_only_where_the_request_admits_it() -> None:
    request = _request()
    c = best_megatron_baseline(request).best.config
    assert make.baseline_on_balanced_data(request, c) is not None
    for other in ({"pp": 4 if c.pp == 2 else 2}, {"micro_batches": c.micro_batches * 2},
                  {"vpp": 1}):
        assert make.baseline_on_balanced_data(replace(request, **other), c) is None, other
