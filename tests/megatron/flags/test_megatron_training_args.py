"""Bad --omnibal input through the real entry point (Megatron's parser and validation, then ours):
every case exits with status 2 and a message naming what is wrong, and no process group
exists afterwards (one subprocess runs all cases, so the start-up is paid once)."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.data.lengths import from_arrays, load_lengths, read_stats_config, save_lengths
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.make import make_plan
from megatron_omnibal.planner.plan_file.plan import StagePlan, save_plan
from megatron_omnibal.planner.search.request import PlanRequest

pytestmark = pytest.mark.megatron

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "megatron_workers" / "train_validate.py"
EXAMPLE = ROOT / "examples" / "data" / "internvl_subset.npz"


def _stage(r, pp, vit, llm, proj):
    return StagePlan(stage=r, vit_layers=vit, llm_layers=llm, patch_embed=r == 0, projector=proj,
                     llm_embed=proj, head=r == pp - 1, forward_ms=1.0, backward_ms=1.0,
                     peak_memory_gib=1.0)  # fmt: skip


def _plan(path, lengths, stages=None, tp=1, pp=2, **data):
    """A real `omnibal plan` plan for tiny made from `lengths`, with the stages
    (and data fields) replaced where given; pp x 2 stages make it a plan with 2 model chunks
    per rank."""
    request = PlanRequest(model=get_preset("tiny"), hardware=get_hardware("A100-80G"),
                          lengths=lengths, gpus=tp * pp, tp=tp, pp=pp, global_batch=8)  # fmt: skip
    plan = make_plan(request)
    plan = replace(plan, data=replace(plan.data, **data))
    if stages is not None:
        vpp = len(stages) // pp
        plan = replace(plan, stages=tuple(stages), parallel=replace(plan.parallel, vpp=vpp))
    save_plan(plan, path)
    return str(path)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    real = load_lengths(EXAMPLE).subset(np.arange(30))
    counted = read_stats_config(EXAMPLE)  # 256 image tokens per tile
    good = tmp / "lengths.npz"
    save_lengths(real, good, config=counted)
    llava = tmp / "llava.npz"  # 300 tokens cannot hold 2 tiles x 256 image tokens
    save_lengths(from_arrays([2, 3], [300, 700], [2, 3]), llava, config=counted)
    plan4 = _plan(tmp / "plan4.json", real, pp=4)
    plan2 = [_stage(0, 2, (0, 4), (0, 1), True), _stage(1, 2, (4, 4), (1, 4), False)]
    plan_other_data = _plan(tmp / "plan_n.json", real, plan2, num_samples=999)
    plan_ok = _plan(tmp / "plan2.json", real, plan2)
    # A real `omnibal plan` made for another length file (40 samples; the run's has 30), and
    # one made for other lengths of the same count.
    example = load_lengths(EXAMPLE)
    plan_other_file = _plan(tmp / "plan_other_file.json", example.subset(np.arange(40)))
    plan_other_lengths = _plan(tmp / "plan_other_lengths.json", example.subset(np.arange(1, 31)))
    plan_tp2 = _plan(tmp / "plan_tp2.json", real, tp=2)
    chunks = [_stage(0, 4, (0, 4), (0, 1), True)] + [
        _stage(v, 4, (4, 4), (v, v + 1), False) for v in (1, 2, 3)
    ]
    plan_vpp = _plan(tmp / "plan_vpp.json", real, chunks, pack_cost=None)
    vpp_data = json.loads(Path(plan_vpp).read_text())["data"]
    vpp_top = f"{vpp_data['vit_budget']}/{vpp_data['token_budget']}"  # the plan's budgets
    old = json.loads(Path(plan_ok).read_text())
    old["version"] = 1
    plan_v1 = tmp / "plan_v1.json"
    plan_v1.write_text(json.dumps(old))
    old["version"] = 2
    old["stages"][1]["llm_layers"] = [2, 4]
    plan_gap = tmp / "plan_gap.json"
    plan_gap.write_text(json.dumps(old))
    # Levels whose first one recomputes all 4 ViT layers of the plan's stage 0: a run that
    # splits the ViT 2,2 cannot do that.
    with_levels = make_plan(PlanRequest(model=get_preset("tiny"),
                                        hardware=get_hardware("A100-80G"), lengths=real, gpus=2,
                                        tp=1, pp=2, global_batch=8, levels="4/1024"))
    first, top = with_levels.data.levels
    with_levels = replace(with_levels, data=replace(with_levels.data, levels=(
        replace(first, vit_recompute=(4, 0)), top)))
    plan_levels = tmp / "plan_levels.json"
    save_plan(with_levels, plan_levels)
    moe_spec = get_preset("tiny").to_dict()
    moe_spec["llm"].update(num_experts=4, moe_top_k=2, moe_ffn_hidden_size=16)
    moe = tmp / "tiny_moe.json"
    moe.write_text(json.dumps(moe_spec))
    moe_spec["llm"]["moe_top_k"] = 5
    top5 = tmp / "tiny_moe_top5.json"
    top5.write_text(json.dumps(moe_spec))
    base = ["--omnibal", "--omnibal-lengths", str(good), "--omnibal-text-scale", "8",
            "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
            "--lr", "1e-3", "--transformer-impl", "local", "--pipeline-model-parallel-size",
            "2"]  # fmt: skip
    counts = ["--omnibal-model", "tiny", "--omnibal-vit-budget", "16", "--omnibal-token-budget",
              "160", "--omnibal-vit-pp-layers", "4,0"]  # fmt: skip
    moe_counts = ["--omnibal-model", str(moe), *counts[2:], "--omnibal-llm-pp-layers", "1,3"]
    return [
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--expert-model-parallel-size", "2"],
         "--expert-model-parallel-size 2: expert parallel size 2: the LLM has no experts "
         "(llm.num_experts is 0)"),
        ([*base, *moe_counts, "--expert-model-parallel-size", "3"],
         "expert parallel size 3 does not divide the LLM's 4 experts (llm.num_experts); sizes "
         "that work: 1, 2, 4"),
        ([*base, *moe_counts, "--expert-model-parallel-size", "2"],
         "--expert-model-parallel-size 2: the 1 ranks of each pipeline stage do not split"),
        ([*base, *moe_counts, "--moe-layer-freq", "2"],
         "--moe-layer-freq 2: not built with --omnibal"),
        ([*base, *moe_counts, "--moe-shared-expert-intermediate-size", "8"],
         "--moe-shared-expert-intermediate-size 8: not built with --omnibal"),
        ([*base, *moe_counts, "--omnibal-lora-rank", "4"],
         "--omnibal-lora-rank 4: LoRA adapters on a mixture-of-experts LLM are not built"),
        ([*base, *moe_counts, "--num-experts", "8"],
         f"--num-experts 8 disagrees with --omnibal-model {moe}, which sets --num-experts 4"),
        ([*base, *moe_counts, "--omnibal-model", str(top5)],
         "model_spec.llm.moe_top_k: 5 must be between 1 and num_experts 4"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,2"],
         "llm layers add up to 3 over 2 stages, the model has 4"),
        ([*base, "--omnibal-plan", plan4],
         f"--pipeline-model-parallel-size 2 disagrees with --omnibal-plan {plan4}, which sets "
         "--pipeline-model-parallel-size 4"),
        ([*base, "--omnibal-plan", plan_tp2, "--tensor-model-parallel-size", "1"],
         f"--tensor-model-parallel-size 1 disagrees with --omnibal-plan {plan_tp2}, which sets "
         "--tensor-model-parallel-size 2"),
        ([*base, "--omnibal-plan", plan_tp2],
         "2 processes do not divide into model replicas of TP 2 x PP 2 x CP 1"),
        ([*base, "--omnibal-plan", plan_other_data],
         f"has 30 samples, but --omnibal-plan {plan_other_data} was made for a dataset of 999"),
        ([*base, "--omnibal-plan", plan_other_file],
         f"has 30 samples, but --omnibal-plan {plan_other_file} was made for a dataset of 40"),
        ([*base, "--omnibal-plan", plan_other_lengths],
         f"holds other lengths than --omnibal-plan {plan_other_lengths} was made from"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--omnibal-lengths", str(llava)],
         "length record 0: token_num 300 does not hold its 2 real tiles x 256 image tokens"),
        ([*base, "--omnibal-plan", str(plan_v1)],
         f"--omnibal-plan {plan_v1}: version 1: this omnibal reads plan version 2"),
        ([*base, "--omnibal-plan", str(plan_gap)],
         f"--omnibal-plan {plan_gap}: stages[1].llm_layers [2, 4] does not continue at layer 1"),
        ([*base, "--omnibal-plan", plan_ok, "--omnibal-llm-recompute", "0,4"],
         "stage 1: llm_recompute=4 but the stage holds 3 llm layers"),
        ([*base, "--omnibal-plan", plan_ok, "--num-layers", "6"],
         f"--num-layers 6 disagrees with --omnibal-plan {plan_ok}, which sets --num-layers 4"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--hidden-size", "64"],
         "--hidden-size 64 disagrees with --omnibal-model tiny, which sets --hidden-size 32"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--add-qkv-bias"],
         "--add-qkv-bias disagrees with --omnibal-model tiny, which sets no --add-qkv-bias"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--qk-layernorm"],
         "--qk-layernorm disagrees with --omnibal-model tiny, which sets no --qk-layernorm"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--pipeline-model-parallel-layout",
          "Et|tttL"], "--pipeline-model-parallel-layout: with --omnibal the pipeline layout "
         "comes from --omnibal-plan or"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--decoder-first-pipeline-num-layers",
          "1"], "--decoder-first-pipeline-num-layers: with --omnibal the pipeline layout"),
        ([*base, "--omnibal-plan", plan_ok, "--omnibal-precision", "fp32", "--bf16"],
         "--omnibal-precision fp32 disagrees with --bf16"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--no-such-flag"],
         "unrecognized arguments: --no-such-flag"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--omnibal-vit-budget", "0"],
         "argument --omnibal-vit-budget: must be a positive"),
        ([*base, "--omnibal-plan", plan_ok, "--omnibal-model", "small"],
         "--omnibal-model small differs from the model_spec of --omnibal-plan"),
        ([a for a in base if a != str(good) and a != "--omnibal-lengths"]
         + ["--omnibal-plan", plan_ok], "--omnibal needs --omnibal-lengths FILE"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--micro-batch-size", "2"],
         "use --micro-batch-size 1 (got 2)"),
        ([a for a in base if a not in ("--lr", "1e-3")] + [*counts, "--omnibal-llm-pp-layers",
                                                           "1,3"],
         "no learning rate: give --lr"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--min-lr", "0.1"],
         "--min-lr 0.1: must be from 0 to --lr 0.001"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--lr-warmup-fraction", "0.1",
          "--lr-warmup-iters", "1"], "--lr-warmup-fraction 0.1 and --lr-warmup-iters 1: give one"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--lr-warmup-iters", "2"],
         "--lr-warmup-iters 2: the warm-up must end before the decay does (2 iterations"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--adam-beta2", "1.0"],
         "--adam-beta2 1.0: must be in [0, 1)"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--recompute-granularity",
          "selective"], "--recompute-granularity selective"),
        ([*base, "--omnibal-model", "tiny"], "--omnibal needs --omnibal-plan, or"),
        ([*base[:-8], "--train-samples", "8", *base[-6:], *counts, "--omnibal-llm-pp-layers",
          "1,3"], "--train-samples: with --omnibal a step trains a varying number of samples"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--rampup-batch-size", "2", "2",
          "4"], "--rampup-batch-size: with --omnibal the micro-batches per step"),
        ([*base, "--omnibal-plan", str(plan_levels), "--omnibal-vit-pp-layers", "2,2",
          "--omnibal-llm-pp-layers", "0,4"], "the plan's data.levels: level 0 (4/1024): stage 0 "
         "would recompute 4 ViT / 0 LLM layers, it holds 2 / 0"),
        ([*base, *counts, "--omnibal-llm-pp-layers", "1,3", "--omnibal-levels", "8/80x3,16/160x4"],
         "the last level (16/160 x4) must be the budgets and micro-batches (16/160 x2)"),
        ([*base[:8], "3", *base[9:], "--omnibal-plan", plan_vpp],
         f"--omnibal-plan {plan_vpp} has vpp 2 (interleaved 1F1B): the micro-batches per step "
         "(--global-batch-size 3 / DP 1 = 3) must be a multiple of "
         "--pipeline-model-parallel-size 2"),
        ([*base, "--omnibal-plan", plan_vpp, "--omnibal-levels", f"1/64x3,{vpp_top}x2"],
         f"--omnibal-levels / the plan's data.levels with --omnibal-plan {plan_vpp} "
         "(interleaved 1F1B): level 1/64 x3 runs 3 micro-batches per step, not a multiple of "
         "--pipeline-model-parallel-size 2"),
    ] + _lora_cases([*base, *counts, "--omnibal-llm-pp-layers", "1,3"])  # fmt: skip


def _lora_cases(run: list[str]) -> list[tuple[list[str], str]]:
    """LoRA settings the tiny model cannot take, each refused naming the flag and layer."""
    lora = [*run, "--omnibal-lora-rank", "4"]
    return [
        ([*lora, "--omnibal-lora-targets", "linear_qkv,attn.q_proj"],
         "--omnibal-lora-targets: 'attn.q_proj' matches no layer of the model"),
        ([*run, "--omnibal-lora-rank", "0"],
         "argument --omnibal-lora-rank: must be a positive integer, got 0"),
        ([*run, "--omnibal-lora-rank", "40"],
         "--omnibal-lora-rank 40 is above the width of llm.layers.0.self_attention.linear_qkv "
         "(32 -> 64): at most 32"),
        ([*lora, "--omnibal-lora-targets", "vit.*.linear_fc2", "--omnibal-lora-rank", "33"],
         "--omnibal-lora-rank 33 is above the width of vit.layers.0.mlp.linear_fc2 (64 -> 32)"),
        ([*lora, "--omnibal-freeze", "llm"],
         "--omnibal-lora-targets: LoRA on llm.layers.0.mlp.linear_fc1, but the LLM is frozen "
         "by --omnibal-freeze llm"),
        ([*lora, "--omnibal-lora-train", "projector", "--omnibal-freeze", "projector"],
         "--omnibal-lora-train projector: the part is frozen by --omnibal-freeze projector"),
        ([*lora, "--omnibal-lora-train", "head"],
         "--omnibal-lora-*: LoRA train: unknown part(s) head"),
        ([*lora, "--omnibal-lora-save", "adapters"],
         "--omnibal-lora-save adapters: the base weights must come from --pretrained-checkpoint"),
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
