"""`omnibal profile` on real megatron-core layers (CPU, tiny shapes), checked against shapes."""

import json
import os
import subprocess
import sys

import pytest

from megatron_omnibal.data.lengths import from_arrays
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.costs import load_profile
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.make import make_plan
from megatron_omnibal.planner.search.partition import Problem, search
from megatron_omnibal.planner.search.request import PlanRequest

pytestmark = pytest.mark.megatron


def test_profile_tiny_model(tmp_path):
    out = tmp_path / "profile.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_omnibal.cli",
            "profile",
            "--model",
            "tiny",
            "--tiles",
            "2",
            "--tokens",
            "64",
            "--repeats",
            "1",
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
        env=env,
        timeout=300,
    )
    doc = json.loads(out.read_text())
    tiny = get_preset("tiny")
    names = [x["name"] for x in doc["layers"]]
    assert names == [f"vit.{i}" for i in range(4)] + ["projector"] + [f"llm.{i}" for i in range(4)]
    by = {x["name"]: x for x in doc["layers"]}
    mib = 2.0**20
    # a recomputed layer keeps exactly its input (fp32 on CPU): [seq, batch, hidden]
    vit_input = tiny.vit.seq_per_tile * 2 * tiny.vit.hidden_size * 4 / mib
    assert by["vit.1"]["checkpoint_mib"] == vit_input
    assert by["llm.1"]["checkpoint_mib"] == 64 * 1 * tiny.llm.hidden_size * 4 / mib
    assert by["llm.1"]["activation_mib"] > 4 * by["llm.1"]["checkpoint_mib"]
    # megatron-core's layer has exactly the planner's LLM parameter count
    assert doc["measured"]["llm_layer_params"] == tiny.llm.layer_params
    assert doc["measured"]["vit_layer_params"] == pytest.approx(tiny.vit.layer_params, rel=0.01)
    assert all(x["forward_ms"] > 0 and x["backward_ms"] >= 0 for x in doc["layers"])
    costs, options = load_profile(out)
    part = search(Problem(costs, options["micro_batches"]), 3)
    assert part.bounds[0] == 0 and part.bounds[-1] == 9 and part.step_ms > 0
    # and it drives `omnibal plan` in place of the FLOPs model
    vit = [1, 2, 3, 1] * 16
    stats = from_arrays(vit, [v * 4 + 30 for v in vit])
    plan = make_plan(
        PlanRequest(model=tiny, hardware=get_hardware("H100-80G"), lengths=stats, gpus=2, pp=2,
                    global_batch=32, profile=doc)  # fmt: skip
    )
    assert plan.predicted.cost_model == "measured profile"
