"""The baseline search (`best_megatron_baseline`: the best hand-set Megatron-LM configuration
that fits, which `omnibal plan`'s headline compares against), timed side by side with another
version of the package and checked to find the same configurations.

Cases: every real preset family and the two toy models at one GPU count each, on A100-80G and
A100-40G (more configurations run out of memory), each with all of the user's choices, with 1F1B
only, and with the even split and no recompute flags; 400 random samples of 1-3 tiles. Each
version runs in a fresh process (one thread), the two alternating `--repeats` times; the figure
is the median CPU s of all cases per version, and the run stops if the two disagree on any
case's configuration, predicted step, or the counts of configurations searched and fitting.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_baseline_search.py --baseline DIR
        [--repeats 3] [--json PATH]

DIR holds another version's `megatron_omnibal` package, e.g. `git archive REV megatron_omnibal |
tar -x -C DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [("internvl2-8b", 16, 64), ("llava-1.5-7b", 16, 64), ("internvl3.5-8b", 16, 64),
         ("internvl3-8b", 8, 32), ("llava-llama3.1-8b", 16, 64), ("internvl-6b-20b", 32, 128),
         ("qwen2.5-vl-7b", 8, 64), ("internvl3.5-38b", 32, 64), ("tiny", 4, 16),
         ("small", 8, 32)]  # fmt: skip
HARDWARE = ("A100-80G", "A100-40G")
CHOICES = ({}, {"interleave": False}, {"uneven": False, "recompute": False})

# One version's run of every case (argv: package root, cases as JSON): CPU s and the results.
CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from megatron_omnibal.data.lengths import from_arrays
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.search.baseline import best_megatron_baseline
from megatron_omnibal.planner.search.request import PlanRequest
rng = np.random.default_rng(0)
vit = rng.integers(1, 4, 400)
stats = from_arrays(vit, vit * 300 + rng.integers(20, 200, 400))
cases, hardware, choices = json.loads(sys.argv[2])
found, cpu = [], 0.0
for hw in hardware:
    for name, gpus, batch in cases:
        req = PlanRequest(model=get_preset(name), hardware=get_hardware(hw), lengths=stats,
                          gpus=gpus, global_batch=batch)
        for kw in choices:
            start = time.process_time()
            search = best_megatron_baseline(req, **kw)
            cpu += time.process_time() - start
            best = search.best
            found.append([hw, name, sorted(kw), search.searched, search.fitting,
                          None if best is None else [repr(best.config), best.result.step_ms]])
print(json.dumps({"cpu_s": cpu, "found": found}))
"""


def run(root: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), json.dumps([CASES, HARDWARE, CHOICES])],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"the baseline search in {root} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, metavar="DIR",
                        help="a folder holding another version's megatron_omnibal package")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    base = Path(args.baseline).resolve()
    if not (base / "megatron_omnibal").is_dir():
        parser.error(f"--baseline {base}: no megatron_omnibal package there")
    cpu: dict[str, list[float]] = {"this": [], "baseline": []}
    for _ in range(args.repeats):
        mine, theirs = run(ROOT), run(base)
        for i, (a, b) in enumerate(zip(mine["found"], theirs["found"], strict=True)):
            if a != b:
                raise SystemExit(f"case {i} differs:\n  this version: {a}\n  baseline:     {b}")
        cpu["this"].append(mine["cpu_s"])
        cpu["baseline"].append(theirs["cpu_s"])
    this, before = statistics.median(cpu["this"]), statistics.median(cpu["baseline"])
    cases = len(mine["found"])
    print(f"baseline search over {cases} cases (the same configurations and steps found), "
          f"median of {args.repeats}:")
    print(f"  this version {this:.2f} CPU s, baseline {before:.2f} CPU s: {before / this:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"cases": cases, "cpu_s": cpu, "median_this_s": this, "median_baseline_s": before,
             "speedup": before / this}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
