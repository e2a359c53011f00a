"""An LLM depth that divides by no pipeline size, through `megatron_omnibal.pretrain_vlm` and
megatron.training (torchrun, gloo): 7 LLM layers on 3 stages (none on stage 0, which holds half
the ViT; 3 and 4 on the others, each recomputing some), saved in torch_dist and resumed on 2
stages split 2 + 5.

Oracle: the PP=1 run of the same weights (set from each parameter's model-wide name). The PP=3
run's losses and every gradient each optimizer step applies equal PP=1's; the PP=2 run resumes
with the PP=3 run's parameters and continues with PP=1's losses; Megatron's FLOPs figure is the
same at every layout. (tests/megatron/stages/test_megatron_model.py checks 5 and 7 layers on 2
and 4 stages without megatron.training.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_omnibal.models.presets import PRESETS

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from run_records import (  # noqa: E402
    WORKER,
    assert_same_grads,
    head_micro,
    params,
    recorded_run,
    step_grads,
)

LLM_LAYERS, ITERS, SAVED, MICRO = 7, 3, 2, 2
LAYOUTS = {  # (ViT layers per stage, LLM layers per stage)
    "pp1": ("4", "7"),
    "pp3": ("2,2,0", "0,3,4"),
    "pp2": ("4,0", "2,5"),
}


def _flags(lengths_file: Path, model: Path, name: str, *extra: str) -> list[str]:
    vit, llm = LAYOUTS[name]
    return [
        "--omnibal", "--omnibal-model", str(model), "--omnibal-lengths", str(lengths_file),
        "--omnibal-vit-budget", "16", "--omnibal-token-budget", "160",
        "--omnibal-text-scale", "8", "--micro-batch-size", "1", "--global-batch-size",
        str(MICRO), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--clip-grad", "1.0", "--transformer-impl", "local", "--seed", "7",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(ITERS),
        "--log-interval", "1", "--pipeline-model-parallel-size", str(len(vit.split(","))),
        "--omnibal-vit-pp-layers", vit, "--omnibal-llm-pp-layers", llm, *extra,
    ]  # fmt: skip


def _run(nproc: int, out: Path, flags: list[str], env: dict[str, str]) -> SimpleNamespace:
    return recorded_run(WORKER, nproc, out, flags, env)


@pytest.fixture(scope="module")
def runs(lengths_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("uneven")
    spec = PRESETS["tiny"].to_dict()
    spec["llm"]["num_layers"] = LLM_LAYERS
    model = tmp / "tiny7.json"
    model.write_text(json.dumps(spec))
    ckpt = tmp / "ckpt"
    env = {"OMNIBAL_TEST_WEIGHTS": "11", "OMNIBAL_TEST_GRADS": "1",
           "RECORD_PARAMS_AT_STEP": str(SAVED)}  # fmt: skip
    return {
        "pp1": _run(1, tmp / "pp1", _flags(lengths_file, model, "pp1"), env),
        "pp3": _run(3, tmp / "pp3", _flags(lengths_file, model, "pp3", "--save", str(ckpt),
                                           "--save-interval", str(SAVED),
                                           "--omnibal-vit-recompute", "1,2,0",
                                           "--omnibal-llm-recompute", "0,1,3"), env),
        "pp2": _run(2, tmp / "pp2", _flags(lengths_file, model, "pp2", "--load", str(ckpt),
                                           "--ckpt-step", str(SAVED)), env),
    }  # fmt: skip


def test_megatron_takes_the_uneven_layout(runs: dict) -> None:
    """Megatron's own arguments hold the run's split (no even-split check stopped it)."""
    assert "pipeline_model_parallel_layout .................. E|ttt|ttttL" in runs["pp3"].stdout
    assert "pipeline_model_parallel_layout .................. Ett|tttttL" in runs["pp2"].stdout
    assert "num_layers ...................................... 7" in runs["pp3"].stdout


def test_three_stages_train_as_one(runs: dict) -> None:
    stage = {r["pp_rank"]: r for r in runs["pp3"].records.values()}
    assert stage[2]["micro"][0]["checkpointed"] == ["llm.3", "llm.4", "llm.5"]  # global numbers
    assert stage[1]["micro"][0]["checkpointed"] == ["llm.0", "vit.2", "vit.3"]
    pp1, pp3 = head_micro(runs["pp1"].records), head_micro(runs["pp3"].records)
    assert len(pp1) == len(pp3) == MICRO * ITERS
    assert [m["indices"] for m in pp3] == [m["indices"] for m in pp1]
    assert [m["tokens"] for m in pp3] == [m["tokens"] for m in pp1]
    assert [m["loss"] for m in pp3] == pytest.approx([m["loss"] for m in pp1], rel=1e-5)
    ref, got = step_grads(runs["pp1"].out), step_grads(runs["pp3"].out)
    assert len(ref) == len(got) == ITERS
    assert sum(1 for n in ref[0] if n.startswith("llm.layers.")) > 0
    assert_same_grads(got, ref)


def test_torch_dist_saved_at_one_uneven_layout_resumes_at_another(runs: dict) -> None:
    """Saved on 3 stages (LLM 0 + 3 + 4), loaded on 2 (2 + 5): every parameter, by name, is
    the saved run's as step 3 starts (on other stages than it was saved from), and the
    resumed steps give the uninterrupted PP=1 run's losses."""
    saved, saved_stage = params(runs["pp3"].out)
    loaded, loaded_stage = params(runs["pp2"].out)
    assert sorted(loaded) == sorted(saved)
    assert saved_stage["llm.layers.1.mlp.linear_fc1.weight"] == 1
    assert loaded_stage["llm.layers.1.mlp.linear_fc1.weight"] == 0
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    resumed = head_micro(runs["pp2"].records)
    want = head_micro(runs["pp1"].records)[MICRO * SAVED :]
    assert [m["indices"] for m in resumed] == [m["indices"] for m in want]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in want], rel=1e-5)


def test_megatron_flops_count_every_layer_at_every_layout(runs: dict) -> None:
    flops = {name: {r["flops_per_sample"] for r in run.records.values()}
             for name, run in runs.items()}  # fmt: skip
    assert flops["pp1"] == flops["pp3"] == flops["pp2"] and len(flops["pp1"]) == 1
