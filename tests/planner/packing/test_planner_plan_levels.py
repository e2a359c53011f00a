"""`omnibal plan` fills plan.data for the balancer: the modeled pack cost of the chosen partition
and, with --levels, packing levels with their own recompute. Oracles: the planner's memory model
evaluated directly (stage_memory_mib), brute-force recompute, the setting's own stage times, and
the JSON round trip."""

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.cli import main
from megatron_omnibal.data.lengths import load_lengths, save_lengths
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.costs import GROUP_LLM, GROUP_VIT, workload_features
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.cost_model.memory import inflight_1f1b, stage_memory_mib
from megatron_omnibal.planner.make import make_plan, plan_partition
from megatron_omnibal.planner.plan_file.plan import load_plan, save_plan
from megatron_omnibal.planner.search.recompute import cheapest_recompute
from megatron_omnibal.planner.search.request import PlanRequest
from megatron_omnibal.planner.search.setting import budget_mib, make_setting

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "data" / "internvl_subset.npz"
GIVEN = "4/1024,9/2048"


def _request(stats, levels=None, **kw):
    return PlanRequest(model=get_preset("internvl-6b-20b"), hardware=get_hardware("A100-80G"),
                       lengths=stats, gpus=128, tp=1, pp=4, micro_batches=4, levels=levels,
                       **kw)  # fmt: skip


@pytest.fixture(scope="module")
def stats():
    return load_lengths(EXAMPLE)


@pytest.fixture(scope="module")
def plan(stats):
    return make_plan(_request(stats, GIVEN))


def test_levels_end_at_the_budgets_and_keep_tokens_per_step(plan):
    d, m = plan.data, plan.parallel.micro_batches
    assert [(lv.vit_budget, lv.token_budget) for lv in d.levels] == [
        (4, 1024), (9, 2048), (d.vit_budget, d.token_budget)]  # fmt: skip
    assert d.levels[-1].micro_batches == m
    for lv in d.levels[:-1]:  # no xM given: the same tokens per step as the top level
        assert lv.micro_batches == round(m * d.token_budget / lv.token_budget)
    # A BalanceConfig (what pretrain_vlm builds from the plan) accepts them as they are.
    BalanceConfig(dp_size=plan.parallel.dp, micro_batches=m, vit_budget=d.vit_budget,
                  token_budget=d.token_budget, cost=d.pack_cost, levels=d.levels)  # fmt: skip
    assert len(plan.predicted.levels) == len(d.levels)
    assert sum(p.samples for p in plan.predicted.levels) == d.num_samples


def test_every_level_fits_memory_with_the_cheapest_recompute(plan, stats):
    """By the planner's memory model evaluated here: each stage's peak at the level's largest
    pack (all its tokens one sample) with its micro-batches in flight is within the budget,
    the recorded peak is that figure, and the counts are the brute-force cheapest that fit."""
    setting = make_setting(_request(stats), 1, 4, 32, 4,
                           (plan.data.vit_budget, plan.data.token_budget))  # fmt: skip
    bounds, _ = plan_partition(plan)
    budget = budget_mib(setting.hw)
    shorter_has_less_recompute = False
    for lv, pred in zip(plan.data.levels, plan.predicted.levels, strict=True):
        costs = setting.model.at(workload_features([lv.vit_budget], [lv.token_budget],
                                                   [float(lv.token_budget) ** 2])[0])
        for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            counts = {GROUP_VIT: lv.vit_recompute[s], GROUP_LLM: lv.llm_recompute[s]}
            inflight = inflight_1f1b(s, 4, lv.micro_batches)
            peak = stage_memory_mib(costs, lo, hi, counts, inflight)
            assert peak <= budget
            assert pred.peak_memory_gib[s] == pytest.approx(peak / 1024, abs=1e-3)
            best, _ = cheapest_recompute(costs, lo, hi, inflight, budget)
            assert sum(best.values()) == sum(counts.values())
        top = plan.data.levels[-1]
        shorter_has_less_recompute |= sum(lv.vit_recompute) + sum(lv.llm_recompute) < sum(
            top.vit_recompute) + sum(top.llm_recompute)
    assert shorter_has_less_recompute  # the point of levels: short packs recompute less
    assert plan.predicted.epoch_s < plan.predicted.single_level_epoch_s


def test_pack_cost_is_the_partition_stage_time(plan, stats):
    """The recorded pack cost per stage differs between two packs exactly as the setting's own
    stage times (forward + backward + recompute) of the plan's partition do."""
    setting = make_setting(_request(stats), 1, 4, 32, 4,
                           (plan.data.vit_budget, plan.data.token_budget))  # fmt: skip
    bounds, recompute = plan_partition(plan)
    part = setting.problem(float("inf")).evaluate(bounds, recompute)
    packs = workload_features([3.0, 30.0], [900.0, 8000.0], [3e5, 2.5e7])
    fwd, bwd = setting.stage_times(part, packs)
    want = (fwd + bwd)[:, 1] - (fwd + bwd)[:, 0]
    got = plan.data.pack_cost.stage_ms(packs[:, 0], packs[:, 1], packs[:, 2])
    assert got[:, 1] - got[:, 0] == pytest.approx(want, rel=1e-9)


def test_levels_round_trip_through_plan_json(plan, tmp_path):
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    again = load_plan(path)
    assert again == plan and again.data.levels == plan.data.levels
    assert again.predicted.levels == plan.predicted.levels
    doc = json.loads(path.read_text())
    assert doc["data"]["levels"][0]["token_budget"] == 1024
    assert len(doc["data"]["pack_cost"]["tile_ms"]) == 4


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["predicted"]["levels"][0].__setitem__("peak_memory_gib", [90.0] * 4),
         r"predicted.levels\[0\].peak_memory_gib .* exceeds the 76.000 GiB budget"),
        (lambda d: d["data"]["levels"][0].__setitem__("llm_recompute", [0, 0, 99, 0]),
         r"data.levels\[0\]: stage 2 recomputes more layers than it holds"),
        (lambda d: d["data"]["levels"].pop(0), r"predicted.levels: 3 entries for 2 levels"),
        (lambda d: d["data"]["levels"][-1].__setitem__("micro_batches", 5),
         "the last level must be the budgets and parallel.micro_batches"),
        (lambda d: d["data"]["levels"][0].__setitem__("micro_batches", 0),
         r"data.levels\[0\]: Level: micro_batches must be an integer >= 1"),
        (lambda d: d["data"]["pack_cost"].__setitem__("tile_ms", [1.0]),
         "PackCost: tile_ms, token_ms and attention_ms need one value per stage"),
    ],
)  # fmt: skip
def test_bad_levels_in_plan_json_are_refused_naming_the_field(plan, tmp_path, mutate, message):
    doc = plan.to_dict()
    mutate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        load_plan(path)


def test_auto_levels_are_the_chosen_set_or_none(stats):
    """`auto` keeps levels only when they beat one level by the planner's estimate; either way
    the plan records both estimates and stays valid."""
    auto = make_plan(_request(stats, "auto"))
    p = auto.predicted
    assert p.epoch_s is not None and p.epoch_s <= p.single_level_epoch_s
    if auto.data.levels:
        assert auto.data.levels[-1].token_budget == auto.data.token_budget
    else:
        assert p.epoch_s == p.single_level_epoch_s and p.levels == ()
    none = make_plan(_request(stats))
    assert none.data.levels == () and none.predicted.epoch_s is None
    assert none.data.pack_cost == auto.data.pack_cost


@pytest.mark.parametrize(
    ("levels", "message"),
    [
        ("4/1024,9/99999", r"--levels 9/99999: not below the plan's budgets"),
        ("9/2048,4/1024", "--levels 9/2048,4/1024: levels must ascend"),
        ("4-1024", r"--levels: level '4-1024': expected TILES/TOKENS\[xMICRO\]"),
    ],
)
def test_bad_levels_name_the_flag(stats, levels, message):
    with pytest.raises(ValueError, match=message):
        make_plan(_request(stats, levels))


def test_plan_and_simulate_commands_show_the_levels(tmp_path, capsys, stats):
    """The summary lists every level with its step and recompute; `simulate` balances the
    plan's epoch with its levels and with one level and simulates every step of both."""
    lengths = tmp_path / "lengths.npz"
    save_lengths(stats.subset(np.arange(0, len(stats), 7)), lengths)
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "internvl-6b-20b", "--hardware", "A100-80G", "--gpus", "128",
            "--tp", "1", "--pp", "4", "--micro-batches", "4", "--lengths", str(lengths),
            "--levels", GIVEN, "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    plan = load_plan(out)
    assert "packing levels: estimated epoch" in text
    for lv, pred in zip(plan.data.levels, plan.predicted.levels, strict=True):
        row = next(r for r in text.splitlines() if r.split()[:1] == [
            f"{lv.vit_budget}/{lv.token_budget}"])  # fmt: skip
        assert f"{pred.step_ms:.1f}" in row and ",".join(map(str, lv.llm_recompute)) in row
    assert main(["simulate", "--plan", str(out)]) == 0
    text = capsys.readouterr().out
    line = next(r for r in text.splitlines() if r.startswith("epoch with packing levels"))
    rows = [r.split() for r in text.splitlines()[text.splitlines().index(line) + 2:]]
    assert len(rows) == len(plan.data.levels) + 1 and rows[-1][1] == "alone"
    samples = [int(r[-1]) for r in rows]
    assert sum(samples[:-1]) == samples[-1] == plan.data.num_samples
