"""Expert parallelism in the plan's and the baseline's search, the ViT pinned to the first stage,
and requests that cannot be built, refused naming the flag."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_omnibal.data.lengths import from_arrays
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.models.spec import LanguageSpec
from megatron_omnibal.planner.cost_model.hardware import Hardware
from megatron_omnibal.planner.make import make_plan
from megatron_omnibal.planner.plan_file.plan import Plan, PlanError
from megatron_omnibal.planner.search.baseline import best_megatron_baseline
from megatron_omnibal.planner.search.parallel_search import plan_candidates
from megatron_omnibal.planner.search.request import PlanRequest
from megatron_omnibal.planner.search.setting import choose_partition, make_setting

# a slow inter-node link and a 2-GPU node, so that EP across nodes costs and EP within pays
HW = Hardware("probe", 100.0, 6.0, 300.0, 2.0, gpus_per_node=2, reserve_gib=0.0,
              efficiency=0.3)  # fmt: skip


def moe_small():
    """The CPU demo model with a mixture of 8 experts (top 2) of width 352 in its 8 LLM layers."""
    small = get_preset("small")
    llm = LanguageSpec(num_layers=8, hidden_size=256, ffn_hidden_size=704, num_attention_heads=8,
                       num_query_groups=4, vocab_size=2048, num_experts=8, moe_top_k=2,
                       moe_ffn_hidden_size=352)  # fmt: skip
    return replace(small, name="small-moe", llm=llm)


def _request(**kw) -> PlanRequest:
    rng = np.random.default_rng(3)
    vit = rng.integers(1, 6, 200)
    fields = dict(model=moe_small(), hardware=HW, gpus=8, global_batch=32, seed=1,
                  lengths=from_arrays(vit, vit * 16 + rng.integers(8, 400, 200)))
    fields.update(kw)
    return PlanRequest(**fields)


def test_ep_search_finds_the_brute_force_optimum() -> None:
    """tp 1, pp 2, 4 micro-batches on 8 GPUs (dp 4): EP 1, 2 and 4 each partitioned in full;
    the search's best is the fastest of them."""
    request = _request(tp=1, pp=2, micro_batches=4)
    brute = {}
    for ep in (1, 2, 4):
        setting = make_setting(request, 1, 2, 4, 4, ep=ep)
        part, _ = choose_partition(setting, "exact")
        brute[ep] = setting.predict(part, setting.balanced).step_ms
    assert len(set(np.round(list(brute.values()), 6))) == 3  # EP changes the step
    found = plan_candidates(request)
    assert {e.setting.ep for e in found} == {1, 2, 4}
    assert found[0].result.step_ms == pytest.approx(min(brute.values()), rel=1e-9)


def test_the_baseline_searches_ep_too() -> None:
    request = _request(tp=1)
    searched = best_megatron_baseline(request).best
    each = [best_megatron_baseline(replace(request, ep=e)).best for e in (1, 2, 4, 8)]
    steps = [b.result.step_ms for b in each if b is not None]
    assert searched.result.step_ms == pytest.approx(min(steps), rel=1e-12)


def test_a_moe_plan_records_ep_and_its_flags() -> None:
    plan = make_plan(_request(tp=1, pp=2, ep=2))
    assert plan.parallel.ep == 2
    flags = plan.megatron_flags
    assert flags[flags.index("--expert-model-parallel-size") + 1] == "2"
    assert flags[flags.index("--num-experts") + 1] == "8"
    assert flags[flags.index("--moe-router-topk") + 1] == "2"
    base = plan.predicted.baseline
    assert "--expert-model-parallel-size" in base.megatron_flags
    doc = plan.to_dict()
    assert Plan.from_dict(doc) == plan
    doc["parallel"]["ep"] = 3
    with pytest.raises(PlanError, match="ep 3 does not divide dp"):
        Plan.from_dict(doc)


def test_a_plan_written_before_ep_reads_as_ep_1() -> None:
    doc = make_plan(PlanRequest(model=get_preset("small"), hardware=HW, gpus=4, tp=1, pp=2,
                                global_batch=16, seed=1,
                                lengths=_request().lengths)).to_dict()  # fmt: skip
    del doc["parallel"]["ep"]
    if doc["predicted"]["baseline"] is not None:
        del doc["predicted"]["baseline"]["ep"]
    assert Plan.from_dict(doc).parallel.ep == 1
    doc["parallel"]["ep"] = 2
    with pytest.raises(PlanError, match="parallel.ep 2: expert parallelism needs"):
        Plan.from_dict(doc)


@pytest.mark.parametrize(("kw", "message"), [
    ({"ep": 3}, "--ep 3 does not divide the 8 experts"),
    ({"model": get_preset("small"), "ep": 2}, "--ep 2: small has a dense LLM"),
    ({"tp": 2, "pp": 2, "ep": 4}, r"--ep 4 does not divide the data-parallel size 2"),
    ({"gpus": 12, "ep": 8}, "--ep 8 does not divide the --gpus 12"),
    ({"vit_on_first_stage": True, "vpp": 2, "pp": 2}, "--vit-on-first-stage with --vpp 2"),
])  # fmt: skip
def test_requests_that_cannot_be_built_are_refused_naming_the_flag(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        _request(**kw)


def test_the_vit_pinned_to_the_first_stage() -> None:
    """--vit-on-first-stage: stage 0 holds every ViT layer and the projector; never faster than
    the free plan at the same sizes."""
    free = _request(tp=1, pp=4, ep=1, micro_batches=8)
    pinned = replace(free, vit_on_first_stage=True)
    a, b = plan_candidates(free)[0], plan_candidates(pinned)[0]
    nv = free.model.vit.num_layers
    assert b.part.bounds[1] >= nv + 1
    assert a.part.bounds[1] < nv + 1  # the free plan splits the tower here
    assert b.result.step_ms >= a.result.step_ms - 1e-9


def test_omnibal_plan_refuses_ep_on_a_dense_model(tmp_path, capsys) -> None:
    """`omnibal plan --ep` on a dense LLM: exit 2, one line naming --ep, no plan written."""
    from megatron_omnibal import cli
    from megatron_omnibal.data.lengths import save_lengths

    save_lengths(_request().lengths, tmp_path / "l.npz")
    out = tmp_path / "plan.json"
    code = cli.main(["plan", "--model", "small", "--hardware", "H100-80G", "--gpus", "8",
                     "--lengths", str(tmp_path / "l.npz"), "--ep", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--ep 2: small has a dense LLM" in err and not out.exists()


def test_omnibal_simulate_replays_a_moe_plan_at_its_ep(tmp_path, capsys) -> None:
    """plan -> plan.json -> `omnibal simulate` (the plan and its baseline) reproduces the
    recorded steps: the replay prices the experts at the plan's own EP."""
    import json
    import re

    from megatron_omnibal import cli
    from megatron_omnibal.data.lengths import save_lengths

    save_lengths(_request().lengths, tmp_path / "l.npz")
    (tmp_path / "m.json").write_text(json.dumps(moe_small().to_dict()))
    (tmp_path / "hw.json").write_text(json.dumps(HW.to_dict()))
    out = str(tmp_path / "plan.json")
    assert cli.main(["plan", "--model", str(tmp_path / "m.json"), "--hardware",
                     str(tmp_path / "hw.json"), "--gpus", "8", "--global-batch", "32",
                     "--seed", "1", "--tp", "1", "--pp", "2", "--ep", "4",
                     "--lengths", str(tmp_path / "l.npz"), "--out", out]) == 0  # fmt: skip
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["parallel"]["ep"] == 4
    for extra, want in (([], plan["predicted"]["step_ms"]),
                        (["--baseline"], plan["predicted"]["baseline"]["step_ms"])):
        capsys.readouterr()
        assert cli.main(["simulate", "--plan", out, *extra]) == 0
        step = float(re.search(r"step ([0-9.]+) ms", capsys.readouterr().out).group(1))
        assert step == pytest.approx(want, abs=1e-3)


def test_omnibal_plan_vit_on_first_stage(tmp_path) -> None:
    """`omnibal plan --vit-on-first-stage`: the written plan's stage 0 holds the whole tower
    and the projector."""
    import json

    from megatron_omnibal import cli
    from megatron_omnibal.data.lengths import save_lengths

    save_lengths(_request().lengths, tmp_path / "l.npz")
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "--model", "small", "--hardware", "H100-80G", "--gpus", "8",
                     "--tp", "1", "--pp", "4", "--micro-batches", "8", "--global-batch", "32",
                     "--lengths", str(tmp_path / "l.npz"), "--vit-on-first-stage",
                     "--out", str(out)]) == 0  # fmt: skip
    stage0 = json.loads(out.read_text())["stages"][0]
    assert stage0["vit_layers"] == [0, get_preset("small").vit.num_layers] and stage0["projector"]
