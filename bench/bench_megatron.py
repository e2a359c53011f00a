"""The OmniBal ablation measured for real on this CPU, each step its own Megatron training run,
with the planner's prediction beside each measurement.

For each of two VLM shapes, four runs of megatron.training.pretrain (1F1B, PP=2, 2 gloo ranks,
one thread each) through megatron_omnibal's entry point (`pretrain_vlm.main`, the function
behind `python -m megatron_omnibal.pretrain_vlm`, with a model_spec file and the
--omnibal-vit-pp-layers / --omnibal-llm-pp-layers / recompute flags, or the plan), on real
InternVL lengths (a random subset of the shipped data):

  baseline     Megatron's layout (patch embedding + ViT + projector on stage 0, LLM split
               evenly), every layer recomputed, random fixed-size micro-batches with every
               sample padded to the longest of its micro-batch
  +data        the same layout and recompute, balanced micro-batches (the planner's budgets)
  +partition   the partition the planner's exact search finds, every layer still recomputed
  +recompute   the planner's plan (`--omnibal-plan`): partition and per-stage recompute chosen
               jointly under a per-rank memory budget (modeled: set so the unrestricted split
               does not fit and some recompute is needed; a CPU has no such limit, but the time
               recompute costs is real)
  baseline-vpp2  the baseline on Megatron's interleaved 1F1B, 2 model chunks per rank: the
               ViT and projector in rank 0's first chunk, each rank's LLM layers split evenly
               over its chunks, every layer recomputed, padded fixed-size micro-batches (the
               configuration as `--num-virtual-stages-per-pipeline-rank 2` builds it)
  plan-vpp2    the planner's plan searched over 2 x 2 virtual stages (`omnibal plan --vpp 2`,
               same memory budget), trained through `--omnibal-plan` on the interleaved
               schedule
  dp_balanced  the baseline's layout and recompute on the packs of Megatron-Core's
               `--sequence-packing-scheduler dp_balanced` (balance/dp_balanced.py): the balanced
               runs' samples per step, packed in order up to its maximum sequence length chosen
               at equal memory (the largest whose packs keep the plan's tile and token budgets),
               dealt to the DP ranks in turn. Megatron with that scheduler runs each global
               batch's pack count / DP micro-batches; here every step runs the mean of those
               counts (rounded), each rank taking its dp_balanced packs in their order (the
               packs and their pairing across DP ranks are dp_balanced's, the step boundaries
               fall a little elsewhere)

Predictions use the planner's pipeline simulator and stage accounting on exactly the
micro-batches each timed step trained on (recorded by the worker), with layer costs from
`omnibal profile` measured on this CPU:
  predicted  two profiles (the mean balanced micro-batch, and twice its tiles with the mean
             padded baseline micro-batch's tokens), fitted per layer: ViT and projector
             a x tiles + c, LLM a x tokens + q x tokens^2 (on a CPU the local attention runs
             over the whole packed micro-batch under a mask, so its cost grows with the packed
             length squared)
  linear     the planner as `omnibal plan --profile` uses one profile: costs proportional to
             tiles / tokens from the first profile (shown for reference)
Each profile is the median of `--profile-runs` runs of `omnibal profile` (per layer and time),
as the step time it predicts is a median: the least of the runs biased the predictions low
(by 12-23% with the least of 4 runs, against 2-13% with the least of 2).
Step time: the wall time of Megatron's `train_step` on rank 0 (the first stage: its schedule
spans the pipeline; with the optimizer step, as the preflight times a step), median over the
timed steps, and with
`--run-repeats N` the median over N runs of that; error = median predicted / median measured
- 1. The profiles and the runs are measured minutes apart:
on a machine shared with other jobs their load differs, which the error then mostly shows.

Shapes (small enough for a CPU; widths set so the measured vision share matches):
  6+20b     vision about half of the layer cost, as InternViT-6B + InternLM2-20B: 64 patches
            per tile pixel-shuffled to 16 image tokens
  llava-7b  vision about a fifth (what the issue asks for a LLaVA-7B-like shape): a CLIP-style
            ViT (class token, dropped before an MLP projector, no pixel shuffle)

With --dp 2 every run has PP=2 x DP=2 (4 gloo ranks; the step time of rank 0 includes the
gradient reduction, so it waits for the slower replica); predictions and the interleaved rows
are for DP=1 only.

Usage: python bench/bench_megatron.py [--shapes 6+20b,llava-7b] [--steps 12] [--warmup 2]
       [--profile-runs 3] [--run-repeats 1] [--no-predict] [--dp 1]
       [--runs baseline,+data,+partition,+recompute,baseline-vpp2,plan-vpp2,dp_balanced]
       [--work-dir DIR] [--json PATH]
       (also its own torchrun worker: --worker baseline|balanced|dp_balanced OUT -- FLAGS)
Environment: TORCHRUN starts the runs' ranks (default: torchrun of this interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "data" / "internvl_subset.npz"
PP = 2
TEXT_SCALE = 8
DATA_TOKENS_PER_TILE = 256  # InternVL: image tokens per tile counted in the length file
SHAPES = {
    "6+20b": {
        "name": "bench-6+20b-shape",
        "vit": {"num_layers": 8, "hidden_size": 96, "ffn_hidden_size": 384,
                "num_attention_heads": 4, "image_size": 64, "patch_size": 8,
                "norm": "layernorm", "class_token": False},
        "projector": {"type": "pixel_shuffle_mlp", "downsample": 0.5, "hidden_size": 128},
        "llm": {"num_layers": 8, "hidden_size": 128, "ffn_hidden_size": 352,
                "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 1024,
                "norm": "rmsnorm"},
    },
    "llava-7b": {
        "name": "bench-llava-7b-shape",
        "vit": {"num_layers": 8, "hidden_size": 64, "ffn_hidden_size": 256,
                "num_attention_heads": 4, "image_size": 32, "patch_size": 8,
                "norm": "layernorm", "activation": "quick_gelu", "class_token": True,
                "drop_class_token": True, "pre_norm": True, "patch_bias": False},
        "projector": {"type": "mlp", "hidden_size": 128},
        "llm": {"num_layers": 8, "hidden_size": 128, "ffn_hidden_size": 352,
                "num_attention_heads": 4, "num_query_groups": 4, "vocab_size": 1024,
                "norm": "rmsnorm"},
    },
}  # fmt: skip
STEPS = ("baseline", "dp_balanced", "+data", "+partition", "+recompute", "baseline-vpp2",
         "plan-vpp2")
DP_ONE_ONLY = ("baseline-vpp2", "plan-vpp2")  # rows built for DP = 1
RUN_SEED = 3  # every run's --seed (dp_balanced's shuffle of epoch e: RUN_SEED + e)
VPP = 2  # model chunks per rank of the interleaved rows


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        sys.exit(f"bench_megatron: {' '.join(cmd[:8])} ... failed:\n{proc.stderr[-4000:]}")
    return proc


def omnibal(*args: str) -> str:
    return run([sys.executable, "-m", "megatron_omnibal.cli", *args]).stdout


def cpu_hardware(memory_mib: float):
    """The planner's view of this machine: two gloo ranks on one host (a measured profile
    replaces the FLOPs numbers); `memory_mib` is the modeled per-rank budget."""
    from megatron_omnibal.planner.cost_model.hardware import Hardware

    return Hardware(name="cpu-gloo", peak_tflops=1.0, memory_gib=memory_mib / 1024,
                    nvlink_gbs=1.0, network_gbs=1.0, gpus_per_node=PP, efficiency=1.0,
                    reserve_gib=0.0, p2p_latency_ms=0.3, op_overhead_ms=0.0)  # fmt: skip


def layout_flags(part, nv: int) -> list[str]:
    """--omnibal-*-pp-layers and recompute flags of a planner Partition."""
    from megatron_omnibal.planner.cost_model.costs import GROUP_LLM, GROUP_VIT

    vit, llm, vrc, lrc = [], [], [], []
    for (lo, hi), rec in zip(part.stages, part.recompute, strict=True):
        vit.append(max(0, min(hi, nv) - min(lo, nv)))
        llm.append(max(0, hi - max(lo, nv + 1)))
        vrc.append(rec.get(GROUP_VIT, 0))
        lrc.append(rec.get(GROUP_LLM, 0))

    def csv(values: list[int]) -> str:
        return ",".join(str(int(v)) for v in values)

    return ["--omnibal-vit-pp-layers", csv(vit), "--omnibal-llm-pp-layers", csv(llm),
            "--omnibal-vit-recompute", csv(vrc), "--omnibal-llm-recompute", csv(lrc)]  # fmt: skip


def common_flags(lengths: Path, micro: int, steps: int, dp: int = 1) -> list[str]:
    """The length file holds the lengths as the model sees them (no stored configuration)."""
    return [
        "--omnibal", "--omnibal-lengths", str(lengths), "--num-workers", "0",
        "--pipeline-model-parallel-size", str(PP), "--micro-batch-size",
        "1", "--global-batch-size", str(micro * dp), "--train-iters", str(steps), "--lr", "1e-4",
        "--clip-grad", "0", "--transformer-impl", "local", "--seed", str(RUN_SEED),
        "--log-interval", "1000", "--hidden-dropout", "0", "--attention-dropout", "0",
    ]  # fmt: skip


def torchrun(mode: str, out: Path, flags: list[str], dp: int = 1) -> dict:
    """One training run on PP x dp local ranks: torchrun of this interpreter, or $TORCHRUN
    (split on spaces, as the launch scripts read it; the tests give local_ranks,
    docs/launch.md)."""
    launcher = os.environ.get("TORCHRUN", "").split() or [sys.executable, "-m",
                                                          "torch.distributed.run"]  # fmt: skip
    run([*launcher, "--standalone", f"--nproc-per-node={PP * dp}", __file__, "--worker", mode,
         str(out), "--", *flags], timeout=1800)  # fmt: skip
    return {**json.loads((out / "rank0.json").read_text()),
            "step_samples": step_samples(out, PP * dp)}


def step_samples(out: Path, ranks: int) -> list[float]:
    """Samples each step trained over all DP replicas: every rank records its replica's
    micro-batches, and each replica's PP ranks see the same ones."""
    per_rank = [[sum(map(len, step)) for step in
                 json.loads((out / f"rank{r}.json").read_text())["micro_indices"]]
                for r in range(ranks)]  # fmt: skip
    return (np.sum(per_rank, axis=0) / PP).tolist()


def step_features(lengths, micro_indices: list[list[int]], padded: bool) -> np.ndarray:
    """(m, 4) features of one step's micro-batches as the CPU run computes them: tiles, packed
    tokens (fixed-size: every sample padded to the longest), packed tokens squared (the local
    attention's masked [S, S] scores), 1."""
    from megatron_omnibal.planner.cost_model.costs import workload_features

    tiles, tokens = [], []
    for idx in micro_indices:
        tok = lengths.tokens[idx].astype(np.float64)
        tiles.append(float(lengths.vit[idx].sum()))
        tokens.append(float(tok.max() * len(idx) if padded else tok.sum()))
    return workload_features(tiles, tokens, np.square(tokens))


def profile_median(model_file: Path, tiles: int, tokens: int, m: int, args, stem: Path) -> dict:
    """`omnibal profile` run `args.profile_runs` times; each time the median of the runs."""
    docs = []
    for run_index in range(args.profile_runs):
        out = stem.with_name(f"{stem.name}.run{run_index}.json")
        omnibal("profile", "--model", str(model_file), "--tiles", str(tiles), "--tokens",
                str(tokens), "--repeats", str(args.repeats), "--micro-batches", str(m),
                "--out", str(out))  # fmt: skip
        docs.append(json.loads(out.read_text()))
    median = docs[0]
    for i, layer in enumerate(median["layers"]):
        for key in ("forward_ms", "backward_ms", "recompute_ms"):
            layer[key] = statistics.median(doc["layers"][i][key] for doc in docs)
    return median


def fit_costs(model, docs: list[dict]):
    """The profile cost model of docs[0] with its times refitted from two profiles at
    different sizes: ViT/projector a x tiles + c, LLM a x tokens + q x tokens^2 (the third
    feature column then carries the packed length squared)."""
    from megatron_omnibal.planner.cost_model.costs import GROUP_LLM, profile_from_dict

    points = [(profile_from_dict(d)[0], d["measured"]["tiles"], d["measured"]["tokens"])
              for d in docs]  # fmt: skip
    group = np.asarray(model.group)
    rows = {}
    for field in ("forward_ms", "backward_ms", "recompute_ms"):
        out = np.zeros((len(group), 4))
        for u in range(len(group)):
            y = np.array([getattr(c, field)[u] for c, _, _ in points])
            if group[u] == GROUP_LLM:
                x = np.array([[tok, tok**2] for _, _, tok in points], np.float64)
                cols = (1, 2)
            else:
                x = np.array([[tiles, 1.0] for _, tiles, _ in points], np.float64)
                cols = (0, 3)
            coef = np.linalg.lstsq(x, y, rcond=None)[0]
            if coef.min() < 0:  # noise: keep the term that carries the cost, non-negative
                keep = int(np.argmax(coef))
                coef = np.zeros(2)
                coef[keep] = float(y @ x[:, keep] / (x[:, keep] @ x[:, keep]))
            out[u, list(cols)] = coef
        rows[field] = out
    return replace(model, forward=rows["forward_ms"], backward=rows["backward_ms"],
                   recompute=np.maximum(rows["recompute_ms"], rows["forward_ms"]))  # fmt: skip


def measure(mode: str, out: Path, flags: list[str], warmup: int, repeats: int = 1,
            dp: int = 1) -> dict:
    """`repeats` training runs: the median over runs of each run's median step, the steps and
    per-step batches (rank 0's) of the first run (every run trains the same ones)."""
    load = os.getloadavg()[0]
    medians, first = [], None
    for i in range(repeats):
        rec = torchrun(mode, out / f"run{i}", flags, dp)
        times = np.array(rec["train_step_ms"][warmup:])
        medians.append(float(statistics.median(times)))
        if first is None:
            first = {"times_ms": times.tolist(), "micro_indices": rec["micro_indices"][warmup:],
                     "step_samples": rec["step_samples"][warmup:]}
    return {**first, "median_step_ms": float(statistics.median(medians)),
            "run_medians_ms": [round(t, 1) for t in medians],
            "load_average": [round(load, 2), round(os.getloadavg()[0], 2)]}  # fmt: skip


def interleaved_baseline(setting, spec, plan):
    """The baseline-vpp2 configuration: its Partition and the plan file that builds it."""
    from megatron_omnibal.planner.make import stage_plans
    from megatron_omnibal.planner.search.baseline import BaselineConfig, evaluate_config

    nl = spec.llm.num_layers
    config = BaselineConfig(tp=1, pp=PP, dp=1, micro_batch_size=1, micro_batches=setting.m,
                            llm_layers=(nl // PP,) * PP, recompute_vision=True,
                            recompute_num_layers=nl // PP // VPP, vpp=VPP)  # fmt: skip
    part = evaluate_config(setting.problem(float("inf")), config, spec.vit.num_layers)
    chunked = replace(plan, parallel=replace(plan.parallel, vpp=VPP),
                      stages=stage_plans(spec, part),
                      data=replace(plan.data, pack_cost=None))  # fmt: skip
    return part, chunked


def measure_profiles(request, model_file: Path, m: int, args: argparse.Namespace,
                     tmp: Path) -> tuple[list[tuple[int, int]], list[dict]]:
    """Layer profiles at the planner's mean balanced micro-batch and (for the prediction's fit)
    at twice its tiles with the mean padded fixed-size micro-batch's tokens (at least twice the
    balanced ones): the shapes and the profiles."""
    from megatron_omnibal.planner.search.setting import make_setting

    probe = make_setting(request(1e9), 1, PP, args.dp, m)
    mean = probe.balanced.reshape(-1, 4).mean(axis=0)
    padded = probe.fixed.reshape(-1, 4).mean(axis=0)
    shapes = [(max(1, round(mean[0])), max(1, round(mean[1])))]
    shapes.append((2 * shapes[0][0], max(round(padded[1]), 2 * shapes[0][1])))
    if not args.predict:  # the plan needs one profile; only the fit needs the second
        shapes = shapes[:1]
    docs = [profile_median(model_file, tiles, tokens, m, args, tmp / f"profile{i}")
            for i, (tiles, tokens) in enumerate(shapes)]  # fmt: skip
    return shapes, docs


def plan_under_budget(request, profile: dict, dp: int, m: int) -> tuple:
    """A memory budget under the unrestricted split's peak, which forces some recompute (halfway
    down to the least any split needs with everything recomputed), and the plan under it; also
    Megatron's split and the searched one without recompute, without a memory limit."""
    from megatron_omnibal.planner.make import make_plan
    from megatron_omnibal.planner.search.partition import NoFeasiblePartition
    from megatron_omnibal.planner.search.setting import choose_partition, make_setting

    unlimited = make_setting(request(1e9, profile), 1, PP, dp, m)
    megatron, _ = choose_partition(unlimited, "megatron")
    searched, _ = choose_partition(unlimited, "exact", recompute=False)
    free, _ = choose_partition(unlimited, "exact")
    least = float(min(searched.memory_mib.max(), megatron.memory_mib.max()))
    budget = least + 0.5 * (float(free.memory_mib.max()) - least)
    try:
        plan = make_plan(request(budget, profile))
    except NoFeasiblePartition:
        budget = float(free.memory_mib.max()) * 0.95
        plan = make_plan(request(budget, profile))
    return budget, plan, megatron, searched


def interleaved_plans(request, budget: float, profile: dict, setting, spec, plan,
                      args: argparse.Namespace, tmp: Path) -> dict:
    """The runs with virtual stages asked for: the plan searched over them (under the budget
    where it fits) and Megatron's chunked layout, their plan files written; their modeled
    splits by run."""
    from megatron_omnibal.planner.make import make_plan, plan_partition
    from megatron_omnibal.planner.plan_file.plan import save_plan
    from megatron_omnibal.planner.search.interleaved import evaluate_interleaved
    from megatron_omnibal.planner.search.partition import NoFeasiblePartition

    interleaved = {}
    if "plan-vpp2" in args.runs:
        try:
            plan_v = make_plan(request(budget, profile, VPP))
        except NoFeasiblePartition:
            plan_v = make_plan(request(1e9, profile, VPP))
        save_plan(plan_v, tmp / "plan_vpp2.json")
        bounds_v, recompute_v = plan_partition(plan_v)
        interleaved["plan-vpp2"] = evaluate_interleaved(
            setting.problem(float("inf")), bounds_v, recompute_v, PP, VPP
        )
    if "baseline-vpp2" in args.runs:
        interleaved["baseline-vpp2"], chunked = interleaved_baseline(setting, spec, plan)
        save_plan(chunked, tmp / "baseline_vpp2.json")
    return interleaved


def run_dp_balanced(lengths, lengths_file: Path, model_file: Path, plan, budgets: list[str],
                    layout: list[str], megatron_part, balanced_steps: list[int],
                    args: argparse.Namespace, tmp: Path) -> tuple[tuple, dict]:
    """Megatron-Core's dp_balanced packing on Megatron's layout: the balanced runs' samples per
    step (every DP replica's), its maximum sequence length at equal memory, and as many
    micro-batches per step as its global batches make on average (so that its steps train about
    as many samples). Returns its result and its setting."""
    from megatron_omnibal.balance.dp_balanced import dp_balanced, equal_memory_max_seq_len

    dp = args.dp
    per_step = round(float(np.mean(balanced_steps)))
    max_len = equal_memory_max_seq_len(lengths, vit_budget=plan.data.vit_budget,
                                       token_budget=plan.data.token_budget, dp_size=dp,
                                       samples_per_step=per_step, seed=RUN_SEED)
    packed = dp_balanced(lengths, dp_size=dp, samples_per_step=per_step,
                         max_seq_len=max_len, seed=RUN_SEED)
    m_dpb = max(1, round(float(np.mean(packed.meta["micro_batches"]))))
    flags = [*common_flags(lengths_file, m_dpb, args.steps, dp), "--omnibal-model",
             str(model_file), *budgets, *layout, "--omnibal-dp-balanced",
             f"{per_step},{max_len}"]  # fmt: skip
    got = measure("dp_balanced", tmp / "dp_balanced", flags, args.warmup, args.run_repeats, dp)
    setting = {"samples_per_step": per_step, "max_seq_len": max_len, "micro_batches": m_dpb}
    return (got, megatron_part, False), setting


def result_rows(results: dict, lengths, fitted, setting) -> list[dict]:
    """One JSON row per run, in STEPS order: measured step time and samples, the prediction
    (with a fitted cost model) and the run's modeled split, recompute and peak memory."""
    rows = []
    for label in (s for s in STEPS if s in results):
        got, part, padded = results[label]
        samples = float(np.mean(got["step_samples"]))  # over every DP replica
        row = {"step": label, "measured_ms": round(got["median_step_ms"], 1),
               "samples_per_step": round(samples, 2),
               "samples_per_s": round(1000 * samples / got["median_step_ms"], 2)}  # fmt: skip
        if fitted is not None:
            feats = [step_features(lengths, step, padded)[None] for step in got["micro_indices"]]
            pred = float(statistics.median(fitted.predict(part, f).step_ms for f in feats))
            linear = float(statistics.median(setting.predict(part, f).step_ms for f in feats))
            row.update({
                "predicted_ms": round(pred, 1),
                "error": round(pred / got["median_step_ms"] - 1, 4),
                "linear_predicted_ms": round(linear, 1),
                "linear_error": round(linear / got["median_step_ms"] - 1, 4),
            })  # fmt: skip
        rows.append({
            **row,
            "vpp": part.vpp,
            "run_medians_ms": got["run_medians_ms"],
            "measured_steps_ms": [round(t, 1) for t in got["times_ms"]],
            "load_average": got["load_average"],
            "stages": [list(s) for s in part.stages],
            "recompute": [{("vit" if g == 0 else "llm"): int(k) for g, k in r.items()}
                          for r in part.recompute],
            "modeled_peak_mib": [round(float(x), 1) for x in part.memory_mib],
        })  # fmt: skip
    return rows


def run_shape(shape: str, args: argparse.Namespace, tmp: Path) -> dict:
    from megatron_omnibal.data.lengths import load_lengths, save_lengths
    from megatron_omnibal.megatron.stream.data import model_lengths
    from megatron_omnibal.models.spec import ModelSpec
    from megatron_omnibal.planner.cost_model.memory import GIB_MIB
    from megatron_omnibal.planner.make import plan_partition
    from megatron_omnibal.planner.plan_file.plan import save_plan
    from megatron_omnibal.planner.search.baseline import same_parallel_baseline
    from megatron_omnibal.planner.search.request import PlanRequest
    from megatron_omnibal.planner.search.setting import make_setting

    tmp.mkdir(parents=True, exist_ok=True)
    spec = ModelSpec.from_dict(SHAPES[shape])
    model_file = tmp / "model.json"
    model_file.write_text(json.dumps(SHAPES[shape]))
    real = load_lengths(EXAMPLE)
    pick = np.sort(np.random.default_rng(0).choice(len(real), args.samples, replace=False))
    lengths = model_lengths(real.subset(pick), DATA_TOKENS_PER_TILE, spec.tokens_per_tile,
                            TEXT_SCALE)  # fmt: skip
    lengths_file = tmp / "lengths.npz"
    save_lengths(lengths, lengths_file)
    dp = args.dp
    m, gb = args.micro_batches, args.micro_batches * args.samples_per_micro_batch * dp

    def request(memory_mib: float, profile: dict | None = None, vpp: int = 1) -> PlanRequest:
        return PlanRequest(model=spec, hardware=cpu_hardware(memory_mib), lengths=lengths,
                           lengths_path=str(lengths_file), gpus=PP * dp, tp=1, pp=PP, vpp=vpp,
                           micro_batches=m, global_batch=gb, profile=profile,
                           profile_path=None if profile is None else str(tmp / "profile.json"),
                           plan_path=str(tmp / "plan.json"))  # fmt: skip

    shapes, docs = measure_profiles(request, model_file, m, args, tmp)
    (tmp / "profile.json").write_text(json.dumps(docs[0], indent=1))
    profile = docs[0]
    budget, plan, megatron, searched = plan_under_budget(request, profile, dp, m)
    save_plan(plan, tmp / "plan.json")
    setting = make_setting(request(budget, profile), 1, PP, dp, m)
    fitted = replace(setting, model=fit_costs(setting.model, docs)) if args.predict else None
    bounds, recompute = plan_partition(plan)
    planned = setting.problem(float("inf")).evaluate(bounds, recompute)
    megatron_part, _, _ = same_parallel_baseline(setting)
    interleaved = interleaved_plans(request, budget, profile, setting, spec, plan, args, tmp)

    # Fixed-size baseline: as many samples per step as the balanced runs take on average.
    nv = spec.vit.num_layers
    budgets = ["--omnibal-vit-budget", str(plan.data.vit_budget), "--omnibal-token-budget",
               str(plan.data.token_budget)]  # fmt: skip
    base = [*common_flags(lengths_file, m, args.steps, dp), "--omnibal-model",
            str(model_file)]  # fmt: skip
    runs = {
        "+data": ("balanced", [*base, *budgets, *layout_flags(megatron_part, nv)],
                  megatron_part, False),
        "+partition": ("balanced", [*base, *budgets, *layout_flags(searched, nv)], searched,
                       False),
        "+recompute": ("balanced", [*base, "--omnibal-plan", str(tmp / "plan.json"),
                                    "--omnibal-precision", "fp32"], planned, False),
        "plan-vpp2": ("balanced", [*base, "--omnibal-plan", str(tmp / "plan_vpp2.json"),
                                   "--omnibal-precision", "fp32"],
                      interleaved.get("plan-vpp2"), False),
    }  # fmt: skip
    results, dp_balanced_setting = {}, None
    for label in args.runs:  # the balanced runs first: the baselines take their samples
        if label in runs:
            mode, flags, part, padded = runs[label]
            got = measure(mode, tmp / label, flags, args.warmup, args.run_repeats, dp)
            results[label] = (got, part, padded)
    # Fixed-size baseline: as many samples per step as the balanced runs took on average.
    balanced = [idx for got, _, _ in results.values() for idx in got["micro_indices"]]
    per_micro = np.mean([len(i) for step in balanced for i in step])
    balanced_steps = [n for got, _, _ in results.values() for n in got["step_samples"]]
    batch = max(1, round(float(per_micro)))
    if "baseline" in args.runs:
        flags = [*base, *budgets, *layout_flags(megatron_part, nv), "--omnibal-baseline-batch",
                 str(batch)]  # fmt: skip
        results["baseline"] = (measure("baseline", tmp / "baseline", flags, args.warmup,
                                       args.run_repeats, dp), megatron_part, True)  # fmt: skip
    if "dp_balanced" in args.runs:
        results["dp_balanced"], dp_balanced_setting = run_dp_balanced(
            lengths, lengths_file, model_file, plan, budgets, layout_flags(megatron_part, nv),
            megatron_part, balanced_steps, args, tmp
        )
    if "baseline-vpp2" in args.runs:
        flags = [*base, "--omnibal-plan", str(tmp / "baseline_vpp2.json"), "--omnibal-precision",
                 "fp32", "--omnibal-baseline-batch", str(batch)]  # fmt: skip
        results["baseline-vpp2"] = (measure("baseline", tmp / "baseline-vpp2", flags,
                                            args.warmup, args.run_repeats),
                                    interleaved["baseline-vpp2"], True)  # fmt: skip

    rows = result_rows(results, lengths, fitted, setting)
    cost = {g: sum(x["forward_ms"] + x["backward_ms"] for x in profile["layers"]
                   if x["group"] == g) for g in ("vit", "llm")}  # fmt: skip
    return {
        "shape": shape,
        "model": SHAPES[shape],
        "vision_share_measured": round(cost["vit"] / (cost["vit"] + cost["llm"]), 3),
        "profiles_at": [{"tiles": t, "tokens": n} for t, n in shapes],
        "budgets": {"vit": plan.data.vit_budget, "tokens": plan.data.token_budget},
        "baseline_batch": batch,
        "dp": dp,
        "dp_balanced": dp_balanced_setting,
        "memory_budget_mib": round(budget, 1),
        "memory_budget_gib": round(budget / GIB_MIB, 4),
        "micro_batches": m,
        "rows": rows,
    }


def print_shape(res: dict) -> None:
    at = ", ".join(f"{p['tiles']} tiles / {p['tokens']} tokens" for p in res["profiles_at"])
    dpb = res.get("dp_balanced")
    dpb = (f"; dp_balanced {dpb['samples_per_step']} samples/step, max length "
           f"{dpb['max_seq_len']}, {dpb['micro_batches']} micro-batches/step" if dpb else "")
    print(f"\n{res['shape']}: vision {res['vision_share_measured']:.0%} of the layer cost "
          f"(profiles at {at}); PP={PP} x DP={res['dp']}, {res['micro_batches']} "
          f"micro-batches/step{dpb}; budgets "
          f"{res['budgets']['vit']} tiles / {res['budgets']['tokens']} tokens; baseline "
          f"{res['baseline_batch']} samples per micro-batch, padded; modeled memory budget "
          f"{res['memory_budget_mib']:.0f} MiB per rank")  # fmt: skip
    predicted = "predicted_ms" in res["rows"][0]
    head = f"{'predicted ms':>12} {'error':>7} {'linear ms':>10} {'error':>7} " if predicted else ""
    print(f"  {'step':<13} {'measured ms':>11} {head}{'vs baseline':>11} {'samples':>7} "
          f"{'samples/s':>9}  stages (units) / recompute (load average)")  # fmt: skip
    first = res["rows"][0]["measured_ms"]  # the baseline's, when it ran
    for row in res["rows"]:
        pred = (f"{row['predicted_ms']:>12.1f} {row['error']:>+7.1%} "
                f"{row['linear_predicted_ms']:>10.1f} {row['linear_error']:>+7.1%} "
                if predicted else "")  # fmt: skip
        print(f"  {row['step']:<13} {row['measured_ms']:>11.1f} {pred}"
              f"{first / row['measured_ms']:>10.2f}x {row['samples_per_step']:>7.1f} "
              f"{row['samples_per_s']:>9.2f}  "
              f"{row['stages']} {row['recompute']} "
              f"(load {row['load_average'][0]:.1f}-{row['load_average'][1]:.1f})")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes")
    parser.add_argument("--steps", type=int, default=12, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--micro-batches", type=int, default=4, help="per step (PP=2: 2 x PP)")
    parser.add_argument("--samples-per-micro-batch", type=int, default=6,
                        help="planned samples per balanced micro-batch (sets the budgets)")
    parser.add_argument("--samples", type=int, default=3000, help="random subset of the data")
    parser.add_argument("--repeats", type=int, default=5, help="omnibal profile repeats")
    parser.add_argument("--profile-runs", type=int, default=3,
                        help="omnibal profile runs per shape (the median time of each is kept)")
    parser.add_argument("--run-repeats", type=int, default=1,
                        help="training runs per row (the median of their median steps)")
    parser.add_argument("--runs", default=",".join(STEPS),
                        help="comma-separated ablation steps to run (at least one balanced)")
    parser.add_argument("--no-predict", dest="predict", action="store_false",
                        help="measure only: one profile (for the plan), no predictions")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep the model, lengths, profiles, plan and run records here "
                             "(default: a new temporary folder)")
    parser.add_argument("--dp", type=int, default=1,
                        help="data-parallel ranks (PP x DP local ranks; DP > 1 needs "
                             "--no-predict and no interleaved rows)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            parser.error(f"--shapes: unknown shape {s!r} (known: {', '.join(SHAPES)})")
    args.runs = args.runs.split(",")
    for r in args.runs:
        if r not in STEPS:
            parser.error(f"--runs: unknown step {r!r} (known: {', '.join(STEPS)})")
    if set(args.runs) <= {"baseline", "baseline-vpp2", "dp_balanced"}:
        parser.error("--runs: the baselines take the balanced runs' samples per step: name one")
    if args.run_repeats < 1:
        parser.error("--run-repeats must be >= 1")
    if args.dp < 1:
        parser.error("--dp must be >= 1")
    if args.dp > 1 and (args.predict or set(args.runs) & set(DP_ONE_ONLY)):
        parser.error(f"--dp {args.dp}: predictions and the rows {', '.join(DP_ONE_ONLY)} are "
                     "for DP = 1; pass --no-predict and leave those rows out")
    if args.steps - args.warmup < 3:
        parser.error("need at least 3 timed steps (--steps - --warmup >= 3)")
    tmp = args.work_dir or Path(tempfile.mkdtemp(prefix="bench_megatron_"))
    report = {"note": f"measured on this CPU (PP=2 x DP={args.dp}, {PP * args.dp} gloo ranks, "
                      "1 thread each); predictions from profiles measured here",
              "dp": args.dp, "load_average": os.getloadavg(),
              "steps": args.steps, "warmup": args.warmup, "shapes": []}  # fmt: skip
    for shape in shapes:
        res = run_shape(shape, args, tmp / shape)
        report["shapes"].append(res)
        print_shape(res)
    report["load_average_end"] = os.getloadavg()
    errors = [abs(r["error"]) for s in report["shapes"] for r in s["rows"] if "error" in r]
    if errors:
        print(f"\nlargest prediction error {max(errors):.1%} (goal: within 10% on a quiet "
              "machine)")
    print(f"load average {report['load_average'][0]:.1f} at the start, "
          f"{report['load_average_end'][0]:.1f} at the end")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


# --- torchrun worker ------------------------------------------------------------------------


class FixedBatches:
    """Random fixed-size micro-batches (the usual sampler), in BalancedBatchSampler's protocol."""

    def __init__(self, n: int, batch: int, dp_size: int, dp_rank: int, micro: int, seed: int):
        from megatron_omnibal.balance.config import Level

        self.n, self.batch, self.dp, self.rank, self.micro = n, batch, dp_size, dp_rank, micro
        self.seed, self.epoch, self.step = seed, 0, 0
        self.last_level = 0  # one level
        self.last_epoch = 0  # synthetic samples: the same in every epoch
        self.levels = (Level(vit_budget=1, token_budget=1, micro_batches=micro),)
        self.steps_per_epoch = n // (batch * micro * dp_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.step = epoch, 0

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.step = int(state["epoch"]), int(state["step"])

    def __iter__(self):
        while True:
            order = np.random.default_rng(self.seed + self.epoch).permutation(self.n)
            while self.step < self.steps_per_epoch:
                for micro in range(self.micro):
                    first = ((self.step * self.dp + self.rank) * self.micro + micro) * self.batch
                    yield order[first : first + self.batch].tolist()
                self.step += 1
            self.epoch, self.step = self.epoch + 1, 0


def padded_dataset(make_sample, filler):
    """The loader's dataset with every sample padded to the longest of its micro-batch."""
    from megatron_omnibal.megatron.stream.loader import Loaded, MicroBatchDataset

    class Padded(MicroBatchDataset):
        def load(self, draw):
            samples = [self.make_sample(i, draw.epoch) for i in draw.indices] or [self.filler()]
            return Loaded(draw, padded_collate(samples), list(range(len(draw.indices))),
                          [len(s.images) for s in samples])  # fmt: skip

    return Padded(make_sample, filler)


def padded_collate(samples):
    """Pad every sample to the longest of the micro-batch (pad tokens carry no loss)."""
    import torch

    from megatron_omnibal.megatron.stream.batch import IGNORE_INDEX, Sample, collate

    longest = max(len(s.tokens) for s in samples)
    padded = []
    for s in samples:
        pad = longest - len(s.tokens)
        padded.append(Sample(
            tokens=torch.cat([s.tokens, torch.zeros(pad, dtype=s.tokens.dtype)]),
            labels=torch.cat([s.labels, torch.full((pad,), IGNORE_INDEX, dtype=s.labels.dtype)]),
            images=s.images, image_flags=s.image_flags))  # fmt: skip
    return collate(padded)


def time_train_steps(into: list[float]) -> None:
    """Append the wall time (ms) of each of Megatron's `train_step` calls in this process to
    `into`: the step the preflight times and its calibration predicts (the pipeline schedule,
    gradient reduction and the optimizer step, without the training loop's logging between
    steps)."""
    from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron

    enable_cpu_megatron()  # as the entry point does, before megatron.training is imported
    from megatron.training import training

    inner = training.train_step

    def train_step(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        into.append(1e3 * (time.perf_counter() - start))
        return out

    training.train_step = train_step


class DpBalancedBatches(FixedBatches):
    """This DP rank's packs of dp_balanced (balance/dp_balanced.py), in their order (step,
    micro-batch), `micro` per step of this run; the epoch ends with the last whole step every
    rank can run."""

    def __init__(self, lengths, dp_size: int, dp_rank: int, micro: int, samples_per_step: int,
                 max_seq_len: int, seed: int):
        from megatron_omnibal.balance.dp_balanced import dp_balanced

        super().__init__(len(lengths), 1, dp_size, dp_rank, micro, seed)
        self.make = lambda epoch: dp_balanced(lengths, dp_size=dp_size,
                                              samples_per_step=samples_per_step,
                                              max_seq_len=max_seq_len, seed=seed + epoch)
        plan = self.make(0)
        self.steps_per_epoch = int(np.sum(plan.pack_rank == dp_rank)) // micro

    def __iter__(self):
        while True:
            plan = self.make(self.epoch)
            mine = np.flatnonzero(plan.pack_rank == self.rank)  # (step, micro) order
            while self.step < self.steps_per_epoch:
                for micro in range(self.micro):
                    yield plan.pack(int(mine[self.step * self.micro + micro])).tolist()
                self.step += 1
            self.epoch, self.step = self.epoch + 1, 0


def worker(mode: str, out: Path, flags: list[str]) -> int:
    baseline_batch = dp_balanced_setting = None
    if "--omnibal-baseline-batch" in flags:
        i = flags.index("--omnibal-baseline-batch")
        baseline_batch = int(flags[i + 1])
        flags = flags[:i] + flags[i + 2 :]
    if "--omnibal-dp-balanced" in flags:
        i = flags.index("--omnibal-dp-balanced")
        dp_balanced_setting = [int(x) for x in flags[i + 1].split(",")]
        flags = flags[:i] + flags[i + 2 :]

    from megatron_omnibal.megatron.stages.step import forward_step
    from megatron_omnibal.megatron.training.pretrain_vlm import main as pretrain_main

    dp = int(os.environ.get("WORLD_SIZE", PP)) // PP
    micro = int(flags[flags.index("--global-batch-size") + 1]) // dp
    record: dict = {"train_step_ms": [], "micro_indices": []}
    state = {"calls": 0}
    time_train_steps(record["train_step_ms"])

    def timed_forward_step(data_iterator, model):
        from megatron.core.utils import get_attr_wrapped_model

        source = getattr(data_iterator, "iterable", data_iterator)
        first_chunk = not get_attr_wrapped_model(model, "vp_stage")  # every micro-batch's 1st
        if first_chunk and state["calls"] % micro == 0:
            record["micro_indices"].append([])
        state["calls"] += first_chunk
        output, loss = forward_step(data_iterator, model)
        if first_chunk:
            record["micro_indices"][-1].append([int(i) for i in source.last_indices])
        return output, loss

    def baseline_iterators(settings, spec, _num_samples=None, vp_stage=None):
        """Fixed-size padded micro-batches (or dp_balanced's packs); with model chunks, chunk
        0's stream read by all."""
        from functools import partial

        from megatron_omnibal.megatron.stream.chunk_streams import SharedStream

        if vp_stage:
            return state["stream"].view(vp_stage), None, None

        from megatron.core import parallel_state
        from megatron.training import get_args

        from megatron_omnibal.megatron.stream.batch import SyntheticSamples
        from megatron_omnibal.megatron.stream.data import BalancedDataIterator
        from megatron_omnibal.megatron.stream.iterators import filler_sample
        from megatron_omnibal.megatron.stream.loader import MicroBatchDataset

        args = get_args()
        dp_size = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        make = SyntheticSamples(lambda _epoch: settings.lengths, spec, seed=args.seed)
        if mode == "dp_balanced":  # packed, as the balanced runs' micro-batches
            sampler = DpBalancedBatches(settings.lengths, dp_size, dp_rank,
                                        settings.micro_batches, *dp_balanced_setting,
                                        args.seed)  # fmt: skip
            dataset = MicroBatchDataset(make, partial(filler_sample, spec))
        else:
            sampler = FixedBatches(len(settings.lengths), baseline_batch, dp_size, dp_rank,
                                   settings.micro_batches, args.seed)  # fmt: skip
            dataset = padded_dataset(make, partial(filler_sample, spec))
        it = BalancedDataIterator(sampler, settings.micro_batches, dataset,
                                  start_step=args.iteration)  # fmt: skip
        if settings.vpp > 1:
            state["stream"] = SharedStream(settings.vpp)
            it = state["stream"].attach(it)
        return it, None, None

    status = pretrain_main(flags, timed_forward_step,
                           None if mode == "balanced" else baseline_iterators)  # fmt: skip
    if status:
        return status
    import torch.distributed as dist

    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], Path(sys.argv[3]), sys.argv[5:]))
    sys.exit(main())
