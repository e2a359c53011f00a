"""Bad --omnibal input through the real entry point (Megatron's parser and validation, then ours):
every case exits with status 2 and a message naming what is wrong, and no process group
exists afterwards (one subprocess runs all cases, so the start-up is paid once)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.data.lengths import from_arrays, load_lengths, save_lengths
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.hardware import get_hardware
from megatron_omnibal.planner.plan import make_plan

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "megatron_workers" / "train_validate.py"
EXAMPLE = ROOT / "examples" / "data" / "internvl_subset.npz"


def _tiny_spec() -> dict:
    """The tiny preset's model_spec, written out (what `omnibal plan` puts in plan.json)."""
    return {
        "vit": {"num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64,
                "num_attention_heads": 4, "image_size": 16, "patch_size": 4},
        "projector": {"type": "pixel_shuffle_mlp", "downsample": 0.5, "hidden_size": 48},
        "llm": {"num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64,
                "num_attention_heads": 4, "vocab_size": 128, "num_query_groups": 2},
    }  # fmt: skip


def _stage(r, pp, vit, llm, proj):
    return {"stage": r, "vit_layers": vit, "llm_layers": llm, "patch_embed": r == 0,
            "projector": proj, "llm_embed": proj, "head": r == pp - 1}  # fmt: skip


def _plan(path, stages, tp=1, **data):
    pp = len(stages)
    doc = {"parallel": {"tp": tp, "pp": pp, "dp": 1, "micro_batches": 2},
           "model_spec": _tiny_spec(), "stages": stages,
           "data": {"vit_budget": 16, "token_budget": 160, **data}}  # fmt: skip
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    real = load_lengths(EXAMPLE).subset(np.arange(30))
    good = tmp / "lengths.npz"
    save_lengths(real, good)
    llava = tmp / "llava.npz"  # 300 tokens cannot hold 2 tiles x 256 image tokens
    save_lengths(from_arrays([2, 3], [300, 700], [2, 3]), llava)
    plan4 = _plan(tmp / "plan4.json", [
        _stage(0, 4, [0, 4], [0, 0], True), _stage(1, 4, [4, 4], [0, 1], False),
        _stage(2, 4, [4, 4], [1, 3], False), _stage(3, 4, [4, 4], [3, 4], False)])  # fmt: skip
    plan2 = [_stage(0, 2, [0, 4], [0, 1], True), _stage(1, 2, [4, 4], [1, 4], False)]
    plan_other_data = _plan(tmp / "plan_n.json", plan2, num_samples=999)
    plan_ok = _plan(tmp / "plan2.json", plan2)
    # A real `omnibal plan` made for another length file (40 samples; the run's has 30).
    real_plan = make_plan(get_preset("tiny"), get_hardware("A100-80G"),
                          load_lengths(EXAMPLE).subset(np.arange(40)), 2, 1, 2, global_batch=8)
    plan_other_file = tmp / "plan_other_file.json"
    plan_other_file.write_text(json.dumps(real_plan))
    plan_tp2 = _plan(tmp / "plan_tp2.json", plan2, tp=2)
    base = ["--omnibal", "--omnibal-lengths", str(good), "--omnibal-text-scale", "8",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
            "--lr", "1e-3", "--transformer-impl", "local", "--pipeline-model-parallel-size",
            "2"]  # fmt: skip
    counts = ["--omnibal-model", "tiny", "--omnibal-vit-budget", "16", "--omnibal-token-budget",
              "160", "--omnibal-vit-pp-layers", "4,0"]  # fmt: skip
    return [
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,2"],
         "llm layers add up to 3 over 2 stages, the model has 4"),
        ([*base, "--omnibal-plan", plan4],
         "plan is for pipeline size 4, this run has --pipeline-model-parallel-size 2"),
        ([*base, "--omnibal-plan", plan_tp2],
         f"--omnibal-plan {plan_tp2} was made for tp=2, this run has tp=1"),
        ([*base, "--omnibal-plan", plan_other_data],
         f"has 30 samples, but --omnibal-plan {plan_other_data} was made for a dataset of 999"),
        ([*base, "--omnibal-plan", str(plan_other_file)],
         f"has 30 samples, but --omnibal-plan {plan_other_file} was made for a dataset of 40"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--omnibal-lengths", str(llava)],
         "length record 0: token_num 300 does not hold its 2 real tiles x 256 image tokens"),
        ([*base, "--omnibal-plan", plan_ok, "--omnibal-llm-recompute", "0,4"],
         "stage 1: llm_recompute=4 but the stage holds 3 llm layers"),
        ([*base, "--omnibal-plan", plan_ok, "--num-layers", "6"],
         "--num-layers 6 but the model's LLM has num_layers=4"),
        ([*base, "--omnibal-plan", plan_ok, "--omnibal-model", "small"],
         "--omnibal-model small differs from the model_spec of --omnibal-plan"),
        ([a for a in base if a != str(good) and a != "--omnibal-lengths"]
         + ["--omnibal-plan", plan_ok], "--omnibal needs --omnibal-lengths FILE"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--micro-batch-size", "2"],
         "use --micro-batch-size 1 (got 2)"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--recompute-granularity",
          "selective"], "--recompute-granularity selective"),
        ([*base, "--omnibal-model", "tiny"], "--omnibal needs --omnibal-plan, or"),
        ([*base[:-8], "--train-samples", "8", *base[-6:], *counts, "--omnibal-llm-pp-layers",
          "1,3"], "--train-samples: with --omnibal a step trains a varying number of samples"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--rampup-batch-size", "2", "2",
          "4"], "--rampup-batch-size: with --omnibal the micro-batches per step"),
    ]  # fmt: skip


def test_bad_input_is_refused_before_any_process_group(cases, tmp_path):
    (tmp_path / "cases.json").write_text(json.dumps([argv for argv, _ in cases]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "WORLD_SIZE": "2",
           "RANK": "0", "LOCAL_RANK": "0"}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path / "cases.json"), str(tmp_path / "out.json")],
        env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads((tmp_path / "out.json").read_text())
    for (argv, message), got in zip(cases, results, strict=True):
        assert got["status"] == 2, (argv, got)
        assert not got["process_group"]
        assert len(got["error"]) == 1 and message in got["error"][0], (message, got["error"])
