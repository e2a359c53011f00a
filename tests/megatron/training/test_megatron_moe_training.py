"""A mixture-of-experts VLM through `megatron_omnibal.pretrain_vlm` and megatron.training (2 gloo
ranks, DP=2): expert parallelism with Megatron's DDP, optimizer and torch_dist checkpoints.

Oracle: the EP=1 run of the same weights (set from each parameter's model-wide name, experts
by their global index). The EP=2 run (each rank holds half the experts, tokens dispatched by
all-to-all, expert gradients reduced over the expert-data-parallel group) gives the same losses
and applies the same gradient to every parameter in every step; saved in torch_dist at EP=2,
it resumes at PP=2 (the ViT over both stages) and EP=1 with every parameter as saved and its
optimizer state, continuing with the EP=1 run's losses.
Megatron's log carries the load-balancing loss, ours the experts' token load.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from megatron_omnibal.models.presets import PRESETS

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from run_records import WORKER, head_micro, params, recorded_run  # noqa: E402

ITERS, SAVED, MICRO = 4, 2, 2


def _flags(
    lengths_file: Path, model: Path, *extra: str, vit: str = "4", llm: str = "4"
) -> list[str]:
    return [
        "--omnibal", "--omnibal-model", str(model), "--omnibal-lengths", str(lengths_file),
        "--omnibal-vit-budget", "16", "--omnibal-token-budget", "160",
        "--omnibal-text-scale", "8", "--micro-batch-size", "1", "--global-batch-size",
        str(2 * MICRO), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
        "--clip-grad", "1.0", "--transformer-impl", "local", "--seed", "7",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(ITERS),
        "--log-interval", "1", "--omnibal-vit-pp-layers", vit, "--omnibal-llm-pp-layers", llm,
        "--pipeline-model-parallel-size", str(len(vit.split(","))),
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(lengths_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("moe_training")
    spec = PRESETS["tiny"].to_dict()
    spec["llm"].update(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01)
    model = tmp / "tiny_moe.json"
    model.write_text(json.dumps(spec))
    ckpt = tmp / "ckpt"
    env = {"OMNIBAL_TEST_WEIGHTS": "11", "OMNIBAL_TEST_GRADS": "1",
           "RECORD_PARAMS_AT_STEP": str(SAVED)}  # fmt: skip
    flags = _flags(lengths_file, model)
    ep2 = ["--expert-model-parallel-size", "2"]
    return {
        "ep1": recorded_run(WORKER, 2, tmp / "ep1", flags, env),
        "ep2": recorded_run(WORKER, 2, tmp / "ep2", [*flags, *ep2, "--save", str(ckpt),
                                                     "--save-interval", str(SAVED)], env),
        # 4 ranks: PP=2 (the ViT over both stages, the LLM on the second) x DP=2, EP=1
        "resumed": recorded_run(WORKER, 4, tmp / "resumed", [
            *_flags(lengths_file, model, vit="3,1", llm="0,4"), "--load", str(ckpt),
            "--ckpt-step", str(SAVED)], env),
    }  # fmt: skip


def _merged_grads(out: Path) -> list[dict[str, torch.Tensor]]:
    """Per optimizer step, {global name: gradient} over both ranks (a dense parameter on both
    must hold the same DDP-reduced gradient; each holds its own experts under EP, in an
    optimizer of their own: two torch optimizer steps per training step)."""
    steps: list[dict[str, torch.Tensor]] = [{} for _ in range(ITERS)]
    for path in sorted(out.glob("grads_rank*.pt")):
        recorded = torch.load(path)
        per_step = len(recorded) // ITERS
        assert per_step * ITERS == len(recorded)
        for i, grads in enumerate(recorded):
            for name, g in grads.items():
                step = steps[i // per_step]
                assert name not in step or torch.equal(step[name], g), name
                step[name] = g
    return steps


def _micro_by_rank(run) -> list[list[dict]]:
    return [run.records[r]["micro"] for r in sorted(run.records)]


def test_expert_parallel_training_equals_ep1(runs: dict) -> None:
    ep1, ep2 = runs["ep1"], runs["ep2"]
    assert "expert_model_parallel_size ...................... 2" in ep2.stdout
    a, b = _micro_by_rank(ep1), _micro_by_rank(ep2)
    assert [[m["indices"] for m in r] for r in a] == [[m["indices"] for m in r] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert len(ra) == MICRO * ITERS
        assert [m["loss"] for m in rb] == pytest.approx([m["loss"] for m in ra], rel=1e-5)
    ref, got = _merged_grads(ep1.out), _merged_grads(ep2.out)
    assert len(ref) == len(got) == ITERS
    experts = [n for n in ref[0] if ".mlp.experts.local_experts." in n]
    assert len(experts) == 4 * 4 * 2  # 4 layers x 4 experts x (fc1, fc2), all in the optimizer
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert set(g) == set(r)
        for name, want in r.items():
            assert want.abs().max() > 0, f"step {step}: {name} has no gradient"
            err = float((g[name] - want).abs().max() / want.abs().max())
            assert err <= 1e-5, f"step {step}: gradient of {name} differs by {err:.2e}"


def test_torch_dist_saved_at_ep2_resumes_at_ep1_on_two_pipeline_stages(runs: dict) -> None:
    """Each rank's experts saved under their global index and loaded (with the optimizer state)
    at PP=2 x EP=1, every expert on the second stage; the resumed step gives the uninterrupted
    EP=1 run's losses (Adam's moments of every expert came back, or they would differ)."""
    saved, _ = params(runs["ep2"].out)
    loaded, stage = params(runs["resumed"].out)
    assert sorted(loaded) == sorted(saved)
    assert stage["vit.layers.3.mlp.linear_fc1.weight"] == 1
    assert any(".local_experts.3." in n for n in loaded)
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    resumed = head_micro(runs["resumed"].records)
    want = head_micro(runs["ep1"].records)[MICRO * SAVED :]
    assert [m["indices"] for m in resumed] == [m["indices"] for m in want]
    assert [m["loss"] for m in resumed] == pytest.approx([m["loss"] for m in want], rel=1e-5)


def test_log_shows_the_load_balancing_loss_and_the_expert_load(runs: dict) -> None:
    for name in ("ep1", "ep2", "resumed"):
        out = runs[name].stdout
        assert "load_balancing_loss" in out, name
        lines = [line for line in out.splitlines() if " omnibal: iteration" in line]
        assert len(lines) == (ITERS - SAVED if name == "resumed" else ITERS)
        assert all("| expert tokens max " in line for line in lines), lines[0]
