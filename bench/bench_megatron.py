"""Megatron 1F1B on CPU: baseline batching/split/recompute against OmniBal, and the planner's
prediction against the measurement.

A small VLM shaped like InternVL's 6+20B is trained for real by megatron.training.pretrain at
PP=2 on 2 gloo ranks (OMP_NUM_THREADS=1 each), on real lengths (a random subset of the shipped
InternVL data). In 6+20B the vision tower costs about as much as the LLM per sample (InternViT-6B,
5.5B parameters, sees ~3.95 tiles x 1025 patches; InternLM2-20B, 18.7B, ~1135 tokens: 2.2e13 vs
2.1e13 parameter-token products), each tile's patches are 4x its LLM image tokens (pixel shuffle
0.5) and image tokens dominate the LLM sequence. The bench model keeps those ratios: 64 patches
-> 16 image tokens per tile, text tokens / 8, and tower widths such that the measured ViT and
LLM costs are about equal (the bench prints the measured vision share).

- baseline: whole ViT on stage 0, LLM split evenly, random fixed-size micro-batches with every
  sample padded to the longest of its micro-batch, full recompute of every layer;
- OmniBal: the split `omnibal partition` finds on a layer profile measured on this machine
  (`omnibal profile`), balanced micro-batches (BalancedBatchSampler), the planned recompute.

Both see the same samples per step on average (the baseline's batch size is the balanced mean).
Step time: wall time between step starts on rank 0, median over the timed steps after warm-up.

Usage: python bench/bench_megatron.py [--steps 12] [--warmup 2] [--json PATH]
(also its own torchrun worker: --worker baseline|omnibal OUT -- FLAGS).
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
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "data" / "internvl_subset.npz"
PP = 2
TEXT_SCALE = 8
MODEL_SPEC = {
    "name": "bench-6+20b-shape",
    "vit": {"num_layers": 8, "hidden_size": 96, "ffn_hidden_size": 384,
            "num_attention_heads": 4, "image_size": 64, "patch_size": 8, "norm": "layernorm",
            "class_token": False},
    "projector": {"type": "pixel_shuffle_mlp", "downsample": 0.5, "hidden_size": 128},
    "llm": {"num_layers": 8, "hidden_size": 128, "ffn_hidden_size": 352,
            "num_attention_heads": 4, "num_query_groups": 2, "vocab_size": 1024,
            "norm": "rmsnorm"},
}  # fmt: skip


def vlm_spec():
    from megatron_omnibal.models.spec import ModelSpec

    return ModelSpec.from_dict(MODEL_SPEC)


def model_json(path: Path) -> Path:
    """The model as a planner/trainer model file (`omnibal profile --model`, --omnibal-model)."""
    path.write_text(json.dumps(MODEL_SPEC))
    return path


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        sys.exit(f"bench_megatron: {' '.join(cmd[:6])} ... failed:\n{proc.stderr[-4000:]}")
    return proc


def omnibal(*args: str) -> str:
    return run([sys.executable, "-m", "megatron_omnibal.cli", *args]).stdout


def plan_json(path: Path, stages: list[list[int]], recompute: list[int], nv: int, nl: int,
              micro: int, vit_budget: int, token_budget: int) -> Path:  # fmt: skip
    """A plan.json holding the partition of the profile's units [vit.0.., projector, llm.0..]."""
    out = []
    for r, (lo, hi) in enumerate(stages):
        vit = [min(lo, nv), min(hi, nv)]
        llm = [min(max(lo - nv - 1, 0), nl), min(max(hi - nv - 1, 0), nl)]
        proj = lo <= nv < hi
        units = {"vit": vit[1] - vit[0], "llm": llm[1] - llm[0]}
        # The partition reports one recompute count per stage; give it to the stage's tower
        # that holds layers, ViT first (what the planner's stage entries do for one tower).
        rec_vit = min(recompute[r], units["vit"])
        rec_llm = min(recompute[r] - rec_vit, units["llm"])
        out.append({"stage": r, "vit_layers": vit, "llm_layers": llm, "patch_embed": r == 0,
                    "projector": proj, "llm_embed": proj, "head": r == len(stages) - 1,
                    "vit_recompute": rec_vit, "llm_recompute": rec_llm})  # fmt: skip
    doc = {"parallel": {"tp": 1, "pp": len(stages), "dp": 1, "micro_batches": micro},
           "model_spec": MODEL_SPEC, "stages": out,
           "data": {"vit_budget": vit_budget, "token_budget": token_budget}}  # fmt: skip
    path.write_text(json.dumps(doc, indent=1))
    return path


def common_flags(lengths: Path, micro: int, steps: int, tokens_per_tile: int) -> list[str]:
    return [
        "--omnibal", "--omnibal-lengths", str(lengths), "--omnibal-data-tokens-per-tile",
        str(tokens_per_tile), "--pipeline-model-parallel-size", str(PP), "--micro-batch-size",
        "1", "--global-batch-size", str(micro), "--train-iters", str(steps), "--lr", "1e-4",
        "--clip-grad", "0", "--transformer-impl", "local", "--seed", "3", "--log-interval",
        "1000", "--hidden-dropout", "0", "--attention-dropout", "0",
    ]  # fmt: skip


def torchrun(mode: str, out: Path, flags: list[str]) -> dict:
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={PP}",
         __file__, "--worker", mode, str(out), "--", *flags], timeout=900)  # fmt: skip
    return json.loads((out / "rank0.json").read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--micro-batches", type=int, default=4, help="per step (PP=2: 2 x PP)")
    parser.add_argument("--samples", type=int, default=3000, help="random subset of the data")
    parser.add_argument("--vit-budget", type=int, default=24)
    parser.add_argument("--token-budget", type=int, default=640)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.steps - args.warmup < 10:
        parser.error("need at least 10 timed steps (--steps - --warmup >= 10)")

    from megatron_omnibal.balance.config import BalanceConfig
    from megatron_omnibal.balance.sampler import BalancedBatchSampler
    from megatron_omnibal.data.lengths import load_lengths, save_lengths
    from megatron_omnibal.megatron.data import model_lengths

    spec = vlm_spec()
    tmp = Path(tempfile.mkdtemp(prefix="bench_megatron_"))
    real = load_lengths(EXAMPLE)
    pick = np.sort(np.random.default_rng(0).choice(len(real), args.samples, replace=False))
    lengths = model_lengths(real.subset(pick), 256, spec.tokens_per_tile, TEXT_SCALE)
    save_lengths(lengths, tmp / "lengths.npz")

    m = args.micro_batches
    config = BalanceConfig(dp_size=1, micro_batches=m, vit_budget=args.vit_budget,
                           token_budget=args.token_budget, seed=3)  # fmt: skip
    sampler = BalancedBatchSampler(lengths, config, dp_rank=0)
    per_micro = len(lengths) / (sampler.steps_per_epoch * m)
    baseline_batch = max(1, round(per_micro))
    tiles = int(round(lengths.vit.sum() / (sampler.steps_per_epoch * m)))
    tokens = int(round(lengths.tokens.sum() / (sampler.steps_per_epoch * m)))

    print(f"model {MODEL_SPEC['name']}, PP={PP}, {m} micro-batches/step, {args.samples} "
          f"samples; balanced "
          f"micro-batch: {per_micro:.2f} samples, {tiles} tiles, {tokens} tokens; baseline: "
          f"{baseline_batch} samples padded to the longest", file=sys.stderr)  # fmt: skip
    mfile = model_json(tmp / "model.json")
    omnibal("profile", "--model", str(mfile), "--tiles", str(tiles), "--tokens", str(tokens),
            "--repeats", "5",
            "--micro-batches", str(m), "--out", str(tmp / "profile.json"))  # fmt: skip
    part = json.loads(omnibal("partition", "--profile", str(tmp / "profile.json"), "--pp",
                              str(PP), "--json"))  # fmt: skip
    nv, nl = spec.vit.num_layers, spec.llm.num_layers
    plan = plan_json(tmp / "plan.json", part["stages"], part["recompute"], nv, nl, m,
                     args.vit_budget, args.token_budget)  # fmt: skip
    base = common_flags(tmp / "lengths.npz", m, args.steps, spec.tokens_per_tile)
    results = {}
    for mode, flags in (
        ("baseline", [*base, "--omnibal-model", str(mfile), "--omnibal-vit-budget",
                      str(args.vit_budget), "--omnibal-token-budget", str(args.token_budget),
                      "--omnibal-vit-pp-layers", f"{nv},0", "--omnibal-llm-pp-layers",
                      f"{nl // 2},{nl - nl // 2}", "--omnibal-vit-recompute", f"{nv},0",
                      "--omnibal-llm-recompute", f"{nl // 2},{nl - nl // 2}",
                      "--omnibal-baseline-batch", str(baseline_batch)]),
        ("omnibal", [*base, "--omnibal-plan", str(plan)]),
    ):  # fmt: skip
        rec = torchrun(mode, tmp / mode, flags)
        starts = rec["step_starts"] + [rec["end"]]
        times = np.diff(starts)[args.warmup :] * 1000.0
        results[mode] = {
            "median_step_ms": round(float(statistics.median(times)), 2),
            "timed_steps": len(times),
            "samples_per_step": round(float(np.mean(rec["samples_per_step"])), 2),
            "llm_tokens_per_step": round(float(np.mean(rec["tokens_per_step"])), 1),
        }
    layout = [{"vit": s["vit_layers"], "llm": s["llm_layers"], "projector": s["projector"],
               "vit_recompute": s["vit_recompute"], "llm_recompute": s["llm_recompute"]}
              for s in json.loads(plan.read_text())["stages"]]  # fmt: skip
    measured = results["omnibal"]["median_step_ms"]
    prof = json.loads((tmp / "profile.json").read_text())["layers"]
    cost = {g: sum(x["forward_ms"] + x["backward_ms"] for x in prof if x["group"] == g)
            for g in ("vit", "llm")}  # fmt: skip
    figures = {
        "model": MODEL_SPEC,
        "vision_share_measured": round(cost["vit"] / (cost["vit"] + cost["llm"]), 3),
        "pp": PP,
        "micro_batches": m,
        "budgets": {"vit": args.vit_budget, "tokens": args.token_budget},
        "baseline": results["baseline"],
        "omnibal": results["omnibal"],
        "omnibal_layout": layout,
        "speedup": round(results["baseline"]["median_step_ms"] / measured, 3),
        "predicted_step_ms": part["step_ms"],
        "prediction_error": round((part["step_ms"] - measured) / measured, 4),
        "profile": {"tiles": tiles, "tokens": tokens},
    }
    b, o = results["baseline"], results["omnibal"]
    print(f"baseline: {b['median_step_ms']:.1f} ms/step ({b['samples_per_step']} samples, "
          f"{b['llm_tokens_per_step']:.0f} LLM tokens)")  # fmt: skip
    print(f"omnibal:  {o['median_step_ms']:.1f} ms/step ({o['samples_per_step']} samples, "
          f"{o['llm_tokens_per_step']:.0f} LLM tokens), layout {layout}")  # fmt: skip
    print(f"vision share of the layer cost (profile): {figures['vision_share_measured']:.0%}")
    print(f"step-time ratio baseline/omnibal: {figures['speedup']:.2f}x; planner predicted "
          f"{part['step_ms']:.1f} ms for OmniBal, measured {measured:.1f} ms "
          f"({figures['prediction_error']:+.1%})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


# --- torchrun worker ------------------------------------------------------------------------


class FixedBatches:
    """Random fixed-size micro-batches (the usual sampler), in BalancedBatchSampler's protocol."""

    def __init__(self, n: int, batch: int, dp_size: int, dp_rank: int, micro: int, seed: int):
        self.n, self.batch, self.dp, self.rank, self.micro = n, batch, dp_size, dp_rank, micro
        self.seed, self.epoch, self.step = seed, 0, 0
        self.last_level = 0  # one level
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


def padded_collate(samples):
    """Pad every sample to the longest of the micro-batch (pad tokens carry no loss)."""
    import torch

    from megatron_omnibal.megatron.batch import IGNORE_INDEX, Sample, collate

    longest = max(len(s.tokens) for s in samples)
    padded = []
    for s in samples:
        pad = longest - len(s.tokens)
        padded.append(Sample(
            tokens=torch.cat([s.tokens, torch.zeros(pad, dtype=s.tokens.dtype)]),
            labels=torch.cat([s.labels, torch.full((pad,), IGNORE_INDEX, dtype=s.labels.dtype)]),
            images=s.images, image_flags=s.image_flags))  # fmt: skip
    return collate(padded)


def worker(mode: str, out: Path, flags: list[str]) -> int:
    baseline_batch = None
    if "--omnibal-baseline-batch" in flags:
        i = flags.index("--omnibal-baseline-batch")
        baseline_batch = int(flags[i + 1])
        flags = flags[:i] + flags[i + 2 :]

    from megatron_omnibal.data.lengths import load_lengths
    from megatron_omnibal.megatron.pretrain_vlm import main as pretrain_main
    from megatron_omnibal.megatron.step import forward_step

    micro = int(flags[flags.index("--global-batch-size") + 1])  # DP = 1
    tokens = load_lengths(flags[flags.index("--omnibal-lengths") + 1]).tokens
    record = {"step_starts": [], "samples_per_step": [], "tokens_per_step": []}
    state = {"calls": 0}

    def timed_forward_step(data_iterator, model):
        source = getattr(data_iterator, "iterable", data_iterator)
        if state["calls"] % micro == 0:
            record["step_starts"].append(time.perf_counter())
            record["samples_per_step"].append(0)
            record["tokens_per_step"].append(0)
        state["calls"] += 1
        output, loss = forward_step(data_iterator, model)
        idx = source.last_indices
        record["samples_per_step"][-1] += len(idx)
        padded = int(tokens[idx].max()) * len(idx) if baseline_batch else int(tokens[idx].sum())
        record["tokens_per_step"][-1] += padded
        return output, loss

    def baseline_iterators(settings, spec, _num_samples=None):
        from functools import partial

        from megatron.core import parallel_state
        from megatron.training import get_args

        from megatron_omnibal.megatron.batch import synthetic_sample
        from megatron_omnibal.megatron.data import BalancedDataIterator

        args = get_args()
        sampler = FixedBatches(len(settings.lengths), baseline_batch,
                               parallel_state.get_data_parallel_world_size(),
                               parallel_state.get_data_parallel_rank(), settings.micro_batches,
                               args.seed)  # fmt: skip
        make = partial(synthetic_sample, lengths=settings.lengths, spec=spec, seed=args.seed)
        it = BalancedDataIterator(sampler, settings.micro_batches, make, padded_collate,
                                  start_step=args.iteration)  # fmt: skip
        return it, None, None

    status = pretrain_main(flags, timed_forward_step,
                           baseline_iterators if mode == "baseline" else None)  # fmt: skip
    record["end"] = time.perf_counter()
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
