"""Plans with virtual stages (interleaved 1F1B) trained through `megatron_omnibal.pretrain_vlm`
and megatron.training (torchrun, gloo): each rank builds its model chunks, megatron-core's
interleaved schedule runs them on the balanced packs.

Oracle: the PP=1 run of the same plan-made weights (set from each parameter's model-wide name).
PP=2 x vpp=2 (the ViT split over chunk 0 of both ranks, uneven chunks, per-chunk recompute),
PP=3 x vpp=2 with a tied output head (the ViT over three ranks; the embedding in the head's
rank's other chunk) and PP=2 x vpp=2 with a tied head (the embedding in rank 0's second chunk,
the head in rank 1's) train the same samples with PP=1's losses and apply its gradients at every
step. A PP=2 x vpp=2 run saved at step 2 in torch_dist resumes at the same layout and at PP=2
without virtual stages, both continuing with PP=1's losses from the saved parameters. Runs
started from a saved chunked checkpoint (--pretrained-checkpoint: torch format at its layout,
torch_dist at PP=1 and PP=2 x vpp=2) begin with the saved parameters; the two from torch_dist
train with packing levels (steps of 4 and of 6 micro-batches), PP=2 x vpp=2 as PP=1.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_omnibal.data.lengths import load_lengths
from megatron_omnibal.megatron.stages.layout import layout_from_counts
from megatron_omnibal.models.presets import PRESETS
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.make import make_plan
from megatron_omnibal.planner.plan_file.plan import ParallelSizes, StagePlan, save_plan
from megatron_omnibal.planner.search.request import PlanRequest

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from run_records import (  # noqa: E402
    WORKER,
    assert_same_grads,
    built_params,
    head_micro,
    params,
    recorded_run,
    step_grads,
)

LLM_LAYERS, ITERS, SAVED, MICRO = 6, 3, 2, 6
# name: (pp, vpp, ViT layers per virtual stage, LLM layers per virtual stage, recompute)
LAYOUTS = {
    "pp1": (1, 1, [4], [6], None),
    "pp2v2": (2, 2, [2, 2, 0, 0], [0, 1, 3, 2], ([1, 0, 0, 0], [0, 0, 2, 1])),
    "pp3v2": (3, 2, [1, 2, 1, 0, 0, 0], [0, 0, 0, 2, 3, 1], None),
    "pp2": (2, 1, [4, 0], [2, 4], None),
    "tied_pp2v2": (2, 2, [2, 1, 1, 0], [0, 0, 3, 3], None),
}
# packing levels (steps of the short level first, then one of the top level), trained by
# from_dist and from_dist_pp1
LEVELS = ("--omnibal-levels", f"8/80x4,16/160x{MICRO}")
TIED = ("pp3v2", "tied_pp2v2")  # layouts trained with a tied output head (and tied_pp1)
EMBEDDING, HEAD = "embedding.word_embeddings.weight", "output_layer.weight"


def _spec(tied: bool = False) -> ModelSpec:
    spec = ModelSpec.from_dict({**PRESETS["tiny"].to_dict(), "name": "tiny6"})
    return replace(spec, llm=replace(spec.llm, num_layers=LLM_LAYERS, tie_embeddings=tied))


def _plan(base, name: str, path: Path) -> Path:
    """`base` (an `omnibal plan` of the model) with the layout of LAYOUTS[name]: one stage
    per virtual stage, in model order."""
    pp, vpp, vit, llm, recompute = LAYOUTS[name]
    vit_rc, llm_rc = recompute or (None, None)
    layouts = layout_from_counts(vit, llm, vit_rc, llm_rc, 4, LLM_LAYERS)
    stages = tuple(
        StagePlan(**asdict(st), stage=v, forward_ms=1.0, backward_ms=2.0, peak_memory_gib=1.0)
        for v, st in enumerate(layouts)
    )
    parallel = ParallelSizes(tp=1, pp=pp, dp=1, vpp=vpp, micro_batches=MICRO, gpus=pp)
    # the prediction is the base plan's (nothing here reads it), sized for pp
    units = 4 + 1 + LLM_LAYERS
    cuts = [units * r // pp for r in range(pp + 1)]
    ranges = tuple(zip(cuts[:-1], cuts[1:], strict=True))
    same = replace(base.predicted.same_parallel, unit_ranges=ranges)
    predicted = replace(base.predicted, baseline=None, speedup=None, same_parallel=same)
    save_plan(replace(base, parallel=parallel, stages=stages, predicted=predicted), path)
    return path


def _base_plan(lengths_file: Path, tmp: Path):
    plan = make_plan(PlanRequest(model=_spec(), hardware=get_hardware("A100-80G"),
                                 lengths=load_lengths(lengths_file),
                                 lengths_path=str(lengths_file), gpus=1, tp=1, pp=1,
                                 micro_batches=MICRO, global_batch=MICRO,
                                 plan_path=str(tmp / "plan.json")))  # fmt: skip
    return replace(plan, data=replace(plan.data, vit_budget=16, token_budget=160, pack_cost=None))


def _flags(plan: Path, *extra: str) -> list[str]:
    return [
        "--omnibal", "--omnibal-plan", str(plan), "--omnibal-precision", "fp32",
        "--omnibal-text-scale", "8", "--lr", "1e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--transformer-impl", "local",
        "--seed", "7", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--train-iters", str(ITERS), "--log-interval", "1", *extra,
    ]  # fmt: skip


def _run(nproc: int, out: Path, flags: list[str], env: dict[str, str]) -> SimpleNamespace:
    return recorded_run(WORKER, nproc, out, flags, env, 400)


@pytest.fixture(scope="module")
def runs(lengths_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("vpp")
    base = _base_plan(lengths_file, tmp)
    tied = replace(base, model_spec=_spec(tied=True))
    plans = {name: _plan(tied if name in TIED else base, name, tmp / f"{name}.json")
             for name in LAYOUTS}  # fmt: skip
    plans["tied_pp1"] = _plan(tied, "pp1", tmp / "tied_pp1.json")
    ckpt, ckpt_torch = tmp / "ckpt", tmp / "ckpt_torch"
    env = {"OMNIBAL_TEST_WEIGHTS": "11", "OMNIBAL_TEST_GRADS": "1",
           "RECORD_PARAMS_AT_STEP": str(SAVED), "RECORD_BUILT_PARAMS": "1"}  # fmt: skip
    save = ("--save-interval", str(SAVED))
    # started from step SAVED of a chunked checkpoint, its parameters recorded as step 0 runs:
    # one step from torch format, all steps with packing levels from torch_dist
    start = ("--pretrained-checkpoint", str(ckpt), "--ckpt-step", str(SAVED), *LEVELS)
    start_env = {"RECORD_PARAMS_AT_STEP": "0", "OMNIBAL_TEST_GRADS": "1"}
    return {
        "pp1": _run(1, tmp / "pp1", _flags(plans["pp1"]), env),
        "pp2v2": _run(2, tmp / "pp2v2", _flags(plans["pp2v2"], "--save", str(ckpt), *save), env),
        "tied_pp1": _run(1, tmp / "tied_pp1", _flags(plans["tied_pp1"]), env),
        "pp3v2": _run(3, tmp / "pp3v2", _flags(plans["pp3v2"]), env),
        "tied_pp2v2": _run(2, tmp / "tied_pp2v2", _flags(plans["tied_pp2v2"], "--save",
                                                         str(ckpt_torch), "--ckpt-format",
                                                         "torch", *save), env),
        "resumed": _run(2, tmp / "resumed", _flags(plans["pp2v2"], "--load", str(ckpt),
                                                   "--ckpt-step", str(SAVED)), env),
        "resumed_vpp1": _run(2, tmp / "resumed_vpp1", _flags(plans["pp2"], "--load", str(ckpt),
                                                             "--ckpt-step", str(SAVED)), env),
        "from_torch": _run(2, tmp / "from_torch", _flags(plans["tied_pp2v2"], "--ckpt-format",
                                                         "torch", "--pretrained-checkpoint",
                                                         str(ckpt_torch), "--ckpt-step",
                                                         str(SAVED), "--train-iters", "1"),
                           start_env),
        "from_dist": _run(2, tmp / "from_dist", _flags(plans["pp2v2"], *start), start_env),
        "from_dist_pp1": _run(1, tmp / "from_dist_pp1", _flags(plans["pp1"], *start), start_env),
    }  # fmt: skip


def _losses(run: SimpleNamespace) -> list[float]:
    return [m["loss"] for m in head_micro(run.records)]


def _grads(run: SimpleNamespace, tied: bool) -> list[dict[str, torch.Tensor]]:
    """The run's step gradients; with a tied head, its copy of the embedding checked (the
    summed gradient, as the embedding's) and dropped: PP=1 holds one weight for both."""
    steps = step_grads(run.out)
    for step in steps if tied else ():
        assert torch.equal(step.pop(HEAD), step[EMBEDDING])
    return steps


@pytest.mark.parametrize("name, ref", [("pp2v2", "pp1"), ("pp3v2", "tied_pp1"),
                                       ("tied_pp2v2", "tied_pp1")])  # fmt: skip
def test_virtual_stages_train_as_one_stage(runs: dict, name: str, ref: str) -> None:
    ref, got = runs[ref], runs[name]
    assert [m["indices"] for m in head_micro(got.records)] == [
        m["indices"] for m in head_micro(ref.records)
    ]
    assert len(_losses(ref)) == ITERS * MICRO and sum(_losses(ref)) > 0
    assert _losses(got) == pytest.approx(_losses(ref), rel=1e-5)
    assert_same_grads(_grads(got, name in TIED), step_grads(ref.out))


def test_a_tied_heads_copy_starts_as_the_embedding_in_any_chunk(runs: dict) -> None:
    """As built (before the test weights): the head's copy equals the embedding, in another
    chunk of the same rank (PP=3 x 2) and on another rank (PP=2 x 2)."""
    where = {"pp3v2": (2, 2), "tied_pp2v2": (0, 1)}  # (embedding's rank, head's rank)
    for name, ranks in where.items():
        _, stage = params(runs[name].out)
        assert (stage[EMBEDDING], stage[HEAD]) == ranks
        built = built_params(runs[name].out)
        assert built[EMBEDDING].abs().max() > 0
        assert torch.equal(built[HEAD], built[EMBEDDING]), name


def test_every_rank_runs_each_of_its_chunks_on_every_micro_batch(runs: dict) -> None:
    for name in ("pp2v2", "pp3v2"):
        pp, vpp = LAYOUTS[name][:2]
        recs = runs[name].records
        assert sorted(r["pp_rank"] for r in recs.values()) == list(range(pp))
        for rec in recs.values():
            chunks = [m["chunk"] for m in rec["micro"]]
            assert sorted(set(chunks)) == list(range(vpp))
            per_chunk = [[m["indices"] for m in rec["micro"] if m["chunk"] == c]
                         for c in range(vpp)]  # fmt: skip
            assert all(seen == per_chunk[0] for seen in per_chunk)
            assert len(per_chunk[0]) == ITERS * MICRO


def test_the_vit_spans_chunks_on_two_ranks_and_recompute_is_per_chunk(runs: dict) -> None:
    """Virtual stages [ViT 0-1 | ViT 2-3, projector, LLM 0 | LLM 1-3 | LLM 4-5, head]: chunk 0
    of rank 0 and of rank 1 hold the ViT; recompute 1 ViT layer of virtual stage 0, 2 LLM
    layers of virtual stage 2 (rank 0's chunk 1) and 1 of virtual stage 3."""
    _, stage = params(runs["pp2v2"].out)
    assert [stage[f"vit.layers.{i}.mlp.linear_fc1.weight"] for i in range(4)] == [0, 0, 1, 1]
    llm_ranks = [stage[f"llm.layers.{i}.mlp.linear_fc1.weight"] for i in range(6)]
    assert llm_ranks == [1, 0, 0, 0, 1, 1]
    recomputed = {r["pp_rank"]: r["recomputed"] for r in runs["pp2v2"].records.values()}
    every = ITERS * MICRO
    assert recomputed == {0: {"vit.0": every, "llm.1": every, "llm.2": every},
                          1: {"llm.4": every}}  # fmt: skip


@pytest.mark.parametrize("name", ["resumed", "resumed_vpp1"])
def test_resume_continues_with_the_saved_parameters(runs: dict, name: str) -> None:
    """The torch_dist checkpoint of the PP=2 x vpp=2 run loads at the same layout and at PP=2
    with one chunk per rank (another split of the layers over other chunks)."""
    saved, _ = params(runs["pp2v2"].out)
    loaded, _ = params(runs[name].out)
    assert set(saved) == set(loaded)
    for key, value in saved.items():
        assert torch.equal(value, loaded[key]), key
    resumed = _losses(runs[name])
    assert len(resumed) == (ITERS - SAVED) * MICRO
    assert resumed == pytest.approx(_losses(runs["pp1"])[SAVED * MICRO :], rel=1e-5)


@pytest.mark.parametrize("name, source", [("from_torch", "tied_pp2v2"), ("from_dist", "pp2v2"),
                                          ("from_dist_pp1", "pp2v2")])  # fmt: skip
def test_a_run_starts_from_a_chunked_checkpoint(runs: dict, name: str, source: str) -> None:
    """--pretrained-checkpoint of step 2 of a PP=2 x vpp=2 run: torch format at its layout,
    torch_dist at PP=2 x vpp=2 and at PP=1; every parameter is the saved one as step 0 (of
    the data stream too) starts."""
    saved, _ = params(runs[source].out)
    loaded, _ = params(runs[name].out)
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        assert torch.equal(value, loaded[key]), key
    assert {r["start"] for r in runs[name].records.values()} == {0}


def test_packing_levels_run_their_micro_batches_through_the_chunks(runs: dict) -> None:
    """Started from the torch_dist checkpoint with packing levels, steps of the 8/80 x4 level
    and of the 16/160 x6 one: each chunk of each rank runs each step's micro-batches, and the
    PP=2 x vpp=2 run has the PP=1 run's losses and applies its gradients."""
    ref, got = runs["from_dist_pp1"], runs["from_dist"]
    levels = [m["level"] for m in head_micro(got.records)]
    assert levels[:4] == [0] * 4 and levels.count(0) % 4 == 0 and levels.count(1) % MICRO == 0
    assert levels.count(0) // 4 + levels.count(1) // MICRO == ITERS and 1 in levels
    assert [m["indices"] for m in head_micro(got.records)] == [
        m["indices"] for m in head_micro(ref.records)
    ]
    for rec in got.records.values():
        per_chunk = [[m["indices"] for m in rec["micro"] if m["chunk"] == c] for c in range(2)]
        assert per_chunk[0] == per_chunk[1] and len(per_chunk[0]) == len(levels)
    assert _losses(got) == pytest.approx(_losses(ref), rel=1e-5)
    assert_same_grads(step_grads(got.out), step_grads(ref.out))
