"""Plans with virtual stages (interleaved 1F1B): plan.json's chunk layout, old files, commands."""

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.cli import main
from megatron_omnibal.data.lengths import from_arrays, save_lengths
from megatron_omnibal.megatron.stages.layout import LayoutError, layout_from_plan
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.make import make_plan
from megatron_omnibal.planner.plan_file.plan import Plan, PlanError, load_plan, save_plan
from megatron_omnibal.planner.search.parallel_search import plan_candidates
from megatron_omnibal.planner.search.request import PlanRequest
from megatron_omnibal.planner.simulator.simulate import simulate

OLD_PLAN = Path(__file__).resolve().parents[1] / "data" / "plan_1f1b_v2.json"


@pytest.fixture(scope="module")
def stats():
    rng = np.random.default_rng(0)
    vit = rng.integers(1, 4, 400)
    return from_arrays(vit, vit * 4 + rng.integers(20, 200, 400))


def tiny_request(stats, **kw):
    return PlanRequest(model=get_preset("tiny"), hardware=get_hardware("A100-80G"), lengths=stats,
                       gpus=4, tp=1, pp=2, global_batch=64, **kw)  # fmt: skip


def test_a_plan_file_written_before_virtual_stages_loads_unchanged(tmp_path):
    """plan_1f1b_v2.json was written by the planner before plans had a chunk layout (no
    baseline vpp): it loads as 1F1B, and saving it back keeps every value it had (fields added
    since, such as the baseline's vpp and newer model-spec fields, come with their defaults)."""
    doc = json.loads(OLD_PLAN.read_text())
    assert "vpp" not in doc["predicted"]["baseline"]
    plan = load_plan(OLD_PLAN)
    assert plan.parallel.vpp == 1 and plan.predicted.baseline.vpp == 1
    assert len(plan.stages) == plan.parallel.pp
    save_plan(plan, tmp_path / "again.json")
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["predicted"]["baseline"]["vpp"] == 1
    assert _kept(doc, again)
    assert layout_from_plan(plan, plan.parallel.pp)[0].patch_embed


def _kept(old, new) -> bool:
    """Every key of `old` is in `new` with the same value (dicts compared key by key)."""
    if isinstance(old, dict):
        return isinstance(new, dict) and all(k in new and _kept(v, new[k]) for k, v in old.items())
    return old == new


def test_vpp_plan_lists_virtual_stages_and_replays(stats, tmp_path, capsys):
    plan = make_plan(tiny_request(stats, vpp=2, plan_path=str(tmp_path / "plan.json")))
    pp = plan.parallel.pp
    assert plan.parallel.vpp == 2 and len(plan.stages) == 2 * pp
    assert plan.data.pack_cost.stages == 2 * pp
    # virtual stage v is chunk v // pp of rank v % pp; the chunks of a rank share its peak
    for v, st in enumerate(plan.stages):
        assert st.peak_memory_gib == plan.stages[v % pp].peak_memory_gib
    # the predicted step is the interleaved simulation of the stages' own times (and the sync)
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json") == plan
    save_lengths(stats, tmp_path / "lengths.npz")
    doc = json.loads((tmp_path / "plan.json").read_text())
    doc["data"]["lengths_path"] = str(tmp_path / "lengths.npz")
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    assert main(["simulate", "--plan", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert float(out.split("step ")[1].split()[0]) == pytest.approx(
        plan.predicted.step_ms, rel=1e-4
    )
    # training builds the virtual stages in model order; a run at another PP size is refused
    chunks = layout_from_plan(plan, pp)
    assert [(st.vit_layers, st.llm_layers) for st in chunks] == [
        (st.vit_layers, st.llm_layers) for st in plan.stages
    ]
    with pytest.raises(LayoutError, match="plan is for pipeline size 2"):
        layout_from_plan(plan, 2 * pp)
    with pytest.raises(PlanError, match="one per virtual stage"):
        Plan.from_dict({**doc, "stages": doc["stages"][:pp]})


def test_interleaved_times_of_a_plan_match_the_simulator(stats):
    """The partition the plan came from: the stages' times through the interleaved simulator
    give the search's step with identical micro-batches."""
    best = plan_candidates(tiny_request(stats, vpp=2))[0]
    part, m = best.part, best.setting.m
    f = np.repeat(part.forward_ms[:, None], m, 1)
    b = np.repeat(part.backward_ms[:, None], m, 1)
    p2p = best.setting.problem(np.inf).p2p[list(part.bounds[1:-1])][:, None]
    assert simulate(f, b, 2, 2, p2p).makespan_ms == pytest.approx(part.step_ms)


def test_auto_searches_the_chunk_counts(stats):
    found = plan_candidates(tiny_request(stats, vpp=None))
    chunks = {e.part.vpp for e in found}
    assert 1 in chunks and len(chunks) > 1
    steps = [e.result.step_ms for e in found]
    assert steps == sorted(steps)
    assert make_plan(tiny_request(stats, vpp=None)).parallel.vpp == found[0].part.vpp


def test_requests_megatron_cannot_run_are_refused(stats):
    with pytest.raises(ValueError, match="--vpp 2: virtual stages need pp >= 2"):
        PlanRequest(model=get_preset("tiny"), hardware=get_hardware("A100-80G"),
                    lengths=stats, gpus=4, pp=1, vpp=2)  # fmt: skip
    with pytest.raises(ValueError, match="exact only"):
        tiny_request(stats, vpp=2, mode="bmp")
    with pytest.raises(ValueError, match="1F1B only"):
        tiny_request(stats, vpp=None, levels="auto")
    with pytest.raises(ValueError, match="divisible by pp"):
        make_plan(tiny_request(stats, vpp=2, micro_batches=3))
