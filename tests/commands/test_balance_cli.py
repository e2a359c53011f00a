"""`omnibal balance` end to end: table, plan file, JSON figures, argument errors."""

import json

import numpy as np
import pytest

from megatron_omnibal.balance.plan_io import load_plan
from megatron_omnibal.cli import main
from megatron_omnibal.data.lengths import from_arrays, load_lengths, save_lengths


@pytest.fixture()
def lengths_file(tmp_path):
    rng = np.random.default_rng(0)
    vit = rng.integers(1, 6, 2000)
    stats = from_arrays(vit, 256 * vit + rng.integers(20, 120, 2000))
    path = tmp_path / "lengths.jsonl"
    save_lengths(stats, path)
    return path


@pytest.mark.parametrize("extra", [[], ["--algorithm", "isf"], ["--mode", "grouped"],
                                   ["--auto-budget", "--samples-per-pack", "3"]])
def test_balance_writes_a_valid_plan(lengths_file, tmp_path, capsys, extra):
    budgets = [] if "--auto-budget" in extra else ["--vit-budget", "18", "--token-budget", "6016"]
    out, figures = tmp_path / "plan.npz", tmp_path / "figures.json"
    code = main(["balance", str(lengths_file), "--dp", "8", "--micro-batches", "2",
                 *budgets, *extra, "--out", str(out), "--json", str(figures)])
    assert code == 0
    text = capsys.readouterr().out
    assert "tokens max/mean" in text and "random batching" in text and "took" in text
    plan = load_plan(out)
    plan.check(len(load_lengths(lengths_file)))
    doc = json.loads(figures.read_text())
    assert doc["meta"]["dp"] == 8 and doc["plan"]["steps"] == plan.num_steps
    assert doc["random_batching"]["tokens_max_mean"] > doc["plan"]["tokens_max_mean"]


def test_balance_argument_errors(lengths_file, capsys):
    assert main(["balance", str(lengths_file), "--dp", "8"]) == 2
    assert "--auto-budget" in capsys.readouterr().err
    assert main(["balance", str(lengths_file), "--dp", "8", "--vit-budget", "2",
                 "--token-budget", "6016"]) == 2
    assert "exceeds the budgets" in capsys.readouterr().err


def test_balance_with_levels_curriculum_and_model_cost(tmp_path, capsys):
    from megatron_omnibal.balance.mixes import long_tail_mix

    path = tmp_path / "mix.npz"
    save_lengths(long_tail_mix(3000, seed=2, long_share=0.02, long_tokens=12000), path)
    out = tmp_path / "plan.npz"
    code = main(["balance", str(path), "--dp", "4", "--vit-budget", "48", "--token-budget",
                 "12288", "--levels", "12/3072,24/6144,48/12288", "--curriculum-steps", "3",
                 "--model", "internvl-6b-20b", "--hardware", "A100-80G", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    plan = load_plan(out)
    levels = plan.meta["levels"]
    assert [lv["micro_batches"] for lv in levels] == [4, 2, 1]  # the same tokens per step
    assert (plan.step_levels()[:3] == 0).all()
    assert plan.meta["cost"]["tile_ms"][0] > 0
    assert "modeled time max/mean" in capsys.readouterr().out
    assert main(["balance", str(path), "--dp", "4", "--vit-budget", "48", "--token-budget",
                 "12288", "--cost", "1,1,0", "--model", "tiny"]) == 2
    assert "one of --cost, --model" in capsys.readouterr().err


def test_balance_prices_a_native_resolution_model_at_each_images_size(tmp_path, capsys):
    """Qwen2.5-VL's attention cost follows each image's merge groups as the length file holds
    them (a two-image sample's images apart, text-only samples none), not a default size."""
    from megatron_omnibal.models.presets import get_preset
    from megatron_omnibal.planner.cost_model.hardware import get_hardware
    from megatron_omnibal.planner.packing.pack_cost import model_pack_cost

    vit = np.array([100, 0, 30, 4000, 16] * 20)
    stats = from_arrays(vit, vit + 50)
    multi = {2 + 5 * k: (10, 20) for k in range(20)}
    path = tmp_path / "qwen.npz"
    save_lengths(stats, path, image_tiles=multi)
    out = tmp_path / "plan.npz"
    assert main(["balance", str(path), "--dp", "2", "--vit-budget", "8000", "--token-budget",
                 "9000", "--model", "qwen2.5-vl-7b", "--hardware", "H100-80G", "--out",
                 str(out)]) == 0, capsys.readouterr().err
    images = np.array([100, 4000, 16] * 20 + [10, 20] * 20)  # the images, spelled out
    spec, hw = get_preset("qwen2.5-vl-7b"), get_hardware("H100-80G")
    want = model_pack_cost(spec, hw, 1, 2, image_tiles=images)
    assert load_plan(out).meta["cost"]["tile_ms"] == pytest.approx(list(want.tile_ms))
    assert want.tile_ms != model_pack_cost(spec, hw, 1, 2).tile_ms  # not the default size
