"""Balance benchmark: quality on the real InternVL data, speed on its 17x replicate.

Quality (70,706 real samples, budgets 18 tiles / 6016 tokens): per-step max/mean across DP
ranks of tiles and tokens (mean over steps and p99) and the dataset-mix skew relative to a plain
shuffle, for random batching (4 samples per micro-batch), OmniBal's ISF and our default in both
layout modes, at 8, 16, 32 and 64 ranks with 1, 4 and 8 micro-batches per rank per step.

Speed (1,202,002 records = the real data 17 times): one balance() call (packing, layout,
checks), CPU seconds of this process (the machine is shared, so wall seconds are printed too);
and ISF's packing call alone beside the reference Cython ISF times of shared/data/README.md,
7.7 s at (18, 6016) and 146.5 s at (9, 4096) (10 rounds here).

    .venv/bin/python bench/bench_balance.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_omnibal.data import metrics  # noqa: E402
from megatron_omnibal.data.isf import balance, pack_isf  # noqa: E402
from megatron_omnibal.data.lengths import load_lengths  # noqa: E402

EXAMPLE = ROOT / "examples" / "data" / "internvl_subset.npz"
REFERENCE_CYTHON_S = {(18, 6016): 7.7, (9, 4096): 146.5}  # shared/data/README.md
REFERENCE_RECORDS = 1_202_002
BUDGETS = (18, 6016)


def _timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


def quality(lengths, dps, micros) -> list[dict]:
    rows = []
    vb, tb = BUDGETS
    for dp in dps:
        for micro in micros:
            kw = dict(dp_size=dp, micro_batches=micro, vit_budget=vb, token_budget=tb, seed=0)
            plans = {
                "random batching (4/micro)": (metrics.random_batching(
                    lengths, dp_size=dp, micro_batches=micro, samples_per_micro=4), False),
                "isf": (balance(lengths, algorithm="isf", **kw), True),
                "default random": (balance(lengths, mode="random", **kw), True),
                "default grouped": (balance(lengths, mode="grouped", **kw), True),
            }
            for name, (plan, packed) in plans.items():
                m = metrics.summarize(plan, lengths, packed=packed)
                rows.append({"dp": dp, "micro_batches": micro, "method": name, **m})
    return rows


def speed(lengths, repeats: int) -> list[dict]:
    big = lengths.repeat(repeats)
    rows = []
    cases = [("default random", (18, 6016), dict(mode="random")),
             ("default grouped", (18, 6016), dict(mode="grouped")),
             ("isf", (18, 6016), dict(algorithm="isf")),
             ("isf", (9, 4096), dict(algorithm="isf")),
             ("default random", (9, 4096), dict(mode="random"))]
    for name, (vb, tb), kw in cases:
        plan, cpu, wall = _timed(lambda vb=vb, tb=tb, kw=kw: balance(
            big, dp_size=64, micro_batches=1, vit_budget=vb, token_budget=tb, seed=0, **kw))
        plan.check(len(big))
        rows.append({"method": f"balance() {name}", "budgets": [vb, tb], "records": len(big),
                     "cpu_s": cpu, "wall_s": wall, "steps": plan.num_steps})
    # The packing call alone, as the reference's timing (no layout, no oversize handling).
    for vb, tb in REFERENCE_CYTHON_S:
        (samples, _), cpu, wall = _timed(lambda vb=vb, tb=tb: pack_isf(
            big.vit, big.tokens, vb, tb, rounds=10, seed=0))
        assert len(samples) == len(big)
        row = {"method": "isf packing", "budgets": [vb, tb], "records": len(big), "cpu_s": cpu,
               "wall_s": wall}
        if len(big) == REFERENCE_RECORDS:  # the reference times are for this replicate only
            ref = REFERENCE_CYTHON_S[(vb, tb)]
            row.update(reference_cython_s=ref, speedup_cpu=ref / cpu, speedup_wall=ref / wall)
        rows.append(row)
    return rows


def _print_quality(rows: list[dict]) -> None:
    print(f"quality: {EXAMPLE.name}, budgets {BUDGETS[0]} tiles / {BUDGETS[1]} tokens, "
          "per-step max/mean across ranks (mean over steps, p99)")
    head = (f"{'dp':>3} {'M':>2}  {'method':<26}{'tiles':>8}{'p99':>8}{'tokens':>8}{'p99':>8}"
            f"{'skew/shuffle':>13}{'steps':>7}")
    print(head)
    for r in rows:
        print(f"{r['dp']:>3} {r['micro_batches']:>2}  {r['method']:<26}"
              f"{r['tiles_max_mean']:>8.4f}{r['tiles_max_mean_p99']:>8.4f}"
              f"{r['tokens_max_mean']:>8.4f}{r['tokens_max_mean_p99']:>8.4f}"
              f"{r['mix_skew_ratio']:>13.3f}{r['steps']:>7.0f}")


def _print_speed(rows: list[dict]) -> None:
    print(f"\nspeed: {rows[0]['records']:,} records, dp 64, one balancing call "
          "(CPU s of this process; wall s on the shared machine)")
    print(f"{'method':<26}{'budgets':>12}{'cpu s':>9}{'wall s':>9}{'ref Cython s':>14}"
          f"{'x (cpu)':>9}{'x (wall)':>10}")
    for r in rows:
        ref = r.get("reference_cython_s")
        extra = (f"{ref:>14.1f}{r['speedup_cpu']:>9.1f}{r['speedup_wall']:>10.1f}" if ref
                 else f"{'':>14}{'':>9}{'':>10}")
        budgets = f"({r['budgets'][0]}, {r['budgets'][1]})"
        print(f"{r['method']:<26}{budgets:>12}{r['cpu_s']:>9.2f}{r['wall_s']:>9.2f}{extra}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write all figures as JSON")
    parser.add_argument("--quick", action="store_true",
                        help="64 ranks and 1 micro-batch only, replicate x4 for speed "
                             "(no comparison with the reference times)")
    args = parser.parse_args(argv)
    lengths = load_lengths(EXAMPLE)
    dps, micros, repeats = ((64,), (1,), 4) if args.quick else ((8, 16, 32, 64), (1, 4, 8), 17)
    q = quality(lengths, dps, micros)
    _print_quality(q)
    s = speed(lengths, repeats)
    _print_speed(s)
    if args.json:
        Path(args.json).write_text(json.dumps({"quality": q, "speed": s}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
