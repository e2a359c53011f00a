"""What `make demo` prints from its outputs: the training log condensed, the step-time
comparison in two lines, and the closing summary. Each section of scripts/demo.sh leaves its
figures in a JSON file under the demo's output folder; the summary reads whichever exist.

    python scripts/demo_report.py train TRAIN_LOG OUT_JSON
    python scripts/demo_report.py compare STEP_TIME_JSON
    python scripts/demo_report.py summary OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from megatron_omnibal.workflow.train_log import parse_train_log


def train(log_path: str, out_json: str) -> int:
    parsed = parse_train_log(Path(log_path).read_text())
    rows = [r for r in parsed["rows"] if "loss" in r]  # Megatron logs iteration 1 as well
    balanced = [r for r in rows if "samples" in r]
    if not balanced:
        print(f"demo: no logged iteration in {log_path}", file=sys.stderr)
        return 1
    print("start-up summary (rank 0):")
    for line in parsed["startup"]:
        print(f"  {line}")
    print("\nper logged iteration (means since the previous line; per step: samples, tiles, "
          "tokens; max/mean over the DP ranks, 1.0 = perfect):")
    print(f"{'iteration':>9} {'lm loss':>8} {'ms/step':>8} {'samples':>8} {'tiles':>6} "
          f"{'tokens':>7} {'tokens max/mean':>16} {'tiles max/mean':>15}")  # fmt: skip
    for r in rows:
        figures = (f" {r['samples']:>8.1f} {r['tiles']:>6.0f} {r['tokens']:>7.0f} "
                   f"{r['tokens_max_over_mean']:>16.4f} {r['tiles_max_over_mean']:>15.4f}"
                   if "samples" in r else "")  # fmt: skip
        print(f"{r['iteration']:>9} {r['loss']:>8.3f} {r['ms']:>8.0f}{figures}")
    summary = {
        "iterations": rows[-1]["iteration"],
        "first_loss": rows[0]["loss"],
        "last_loss": rows[-1]["loss"],
        "worst_tokens_max_over_mean": max(r["tokens_max_over_mean"] for r in balanced),
        "worst_tiles_max_over_mean": max(r["tiles_max_over_mean"] for r in balanced),
        "mean_samples_per_step": sum(r["samples"] for r in balanced) / len(balanced),
        "startup": parsed["startup"],
    }
    Path(out_json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def describe_stages(stages: list[list[int]], recompute: list[dict], vit_layers: int) -> str:
    """Planner units (ViT layers, the projector, LLM layers) per stage, in words."""

    def span(name: str, first: int, end: int) -> str:
        return f"{name} {first}" if end - first == 1 else f"{name} {first}-{end - 1}"

    parts = []
    for (lo, hi), rec in zip(stages, recompute, strict=True):
        words = []
        if lo < vit_layers:
            words.append(span("ViT", lo, min(hi, vit_layers)))
        if lo <= vit_layers < hi:
            words.append("projector")
        if hi > vit_layers + 1:
            words.append(span("LLM", max(lo, vit_layers + 1) - vit_layers - 1,
                              hi - vit_layers - 1))  # fmt: skip
        recomputed = sum(rec.values())
        parts.append(" + ".join(words) + (f" ({recomputed} recomputed)" if recomputed else ""))
    return " | ".join(parts)


def compare(step_json: str) -> int:
    report = json.loads(Path(step_json).read_text())
    shape = report["shapes"][0]
    rows = {r["step"]: r for r in shape["rows"]}
    base, ours = rows["baseline"], rows["+recompute"]
    nv = shape["model"]["vit"]["num_layers"]
    timed = report["steps"] - report["warmup"]
    print(f"baseline: {describe_stages(base['stages'], base['recompute'], nv)}; random "
          f"micro-batches of {shape['baseline_batch']} samples, padded to the longest")
    print(f"OmniBal:  {describe_stages(ours['stages'], ours['recompute'], nv)}; balanced "
          f"micro-batches of up to {shape['budgets']['vit']} tiles / "
          f"{shape['budgets']['tokens']} tokens")
    print(f"\n{'':<9}{'median ms/step':>15}{'samples/step':>14}{'samples/s':>11}")
    for name, row in (("baseline", base), ("OmniBal", ours)):
        print(f"{name:<9}{row['measured_ms']:>15.0f}{row['samples_per_step']:>14.1f}"
              f"{row['samples_per_s']:>11.2f}")
    print(f"OmniBal: {ours['samples_per_s'] / base['samples_per_s']:.2f}x the samples per "
          f"second, steps {base['measured_ms'] / ours['measured_ms']:.2f}x shorter (medians of "
          f"{timed} timed steps each). A short CPU run on 2 processes, not a benchmark: "
          "bench/bench_megatron.py measures properly.")
    return 0


def summary(out_dir: str) -> int:
    out = Path(out_dir)
    lines = []
    data = out / "data"
    if (data / "lengths.npz").exists():
        from megatron_omnibal.data.lengths import load_lengths

        lengths = load_lengths(data / "lengths.npz")
        images = len(list((data / "images").iterdir()))
        lines.append(f"data     {len(lengths)} samples over {images} JPEG/PNG files (InternVL "
                     f"meta + JSONL), lengths by `omnibal stats`: {data}")  # fmt: skip
    if (out / "balance.json").exists():
        figures = json.loads((out / "balance.json").read_text())
        plan, rand = figures["plan"], figures["random_batching"]
        lines.append(
            f"balance  {figures['meta']['num_samples']:,} real InternVL samples on "
            f"{figures['meta']['dp_size']} DP ranks, per-step max/mean: tokens "
            f"{plan['tokens_max_mean']:.3f} (random {rand['tokens_max_mean']:.3f}), tiles "
            f"{plan['tiles_max_mean']:.3f} (random {rand['tiles_max_mean']:.3f}): "
            f"{out / 'balance.png'}")
    if (out / "train.json").exists():
        t = json.loads((out / "train.json").read_text())
        lines.append(
            f"train    `omnibal finetune` (stats, plan, convert, train, export, compare-hf): lm "
            f"loss {t['first_loss']:.2f} -> {t['last_loss']:.2f} in {t['iterations']} steps "
            f"on the generated samples (DP=2); per-rank max/mean at worst: tokens "
            f"{t['worst_tokens_max_over_mean']:.3f}, tiles {t['worst_tiles_max_over_mean']:.3f}"
            f": {out / 'finetune' / 'logs' / 'train.log'}")
    report = out / "finetune" / "report.json"
    if report.exists():
        r = json.loads(report.read_text())
        verdict = r["compare_hf"]
        check = (f"compare-hf {'passed' if verdict['ok'] else 'FAILED'} (largest relative "
                 f"difference {verdict['max_rel']:.1e})" if verdict else "compare-hf not run")
        lines.append(f"         exported Hugging Face checkpoint {r['export']}, {check}; "
                     f"report: {report.with_suffix('.md')}")
    if (out / "step_time.json").exists():
        rows = {r["step"]: r for r in
                json.loads((out / "step_time.json").read_text())["shapes"][0]["rows"]}
        base, ours = rows["baseline"], rows["+recompute"]
        gain = ours["samples_per_s"] / base["samples_per_s"]
        lines.append(
            f"compare  PP=2: OmniBal {ours['measured_ms']:.0f} ms/step vs baseline "
            f"{base['measured_ms']:.0f} ms/step, {gain:.2f}x the samples/s (short CPU run): "
            f"{out / 'gantt_omnibal.png'}, {out / 'gantt_baseline.png'}")
    print("\n".join(lines) if lines else f"nothing under {out} yet")
    return 0


def main(argv: list[str]) -> int:
    commands = {"train": (train, 2), "compare": (compare, 1), "summary": (summary, 1)}
    if not argv or argv[0] not in commands or len(argv) - 1 != commands[argv[0]][1]:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    func, _ = commands[argv[0]]
    return func(*argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
