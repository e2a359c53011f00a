"""Run every benchmark under bench/ in turn, each writing its figures to bench/results/NAME.json.

Usage: python bench/run_all.py [NAME ...]
Names: balance, planner, stats, data, megatron, preflight, convert.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ("balance", "planner", "stats", "data", "megatron", "preflight", "convert")


def main(argv: list[str]) -> int:
    names = argv or list(BENCHES)
    unknown = sorted(set(names) - set(BENCHES))
    if unknown:
        print(f"run_all: unknown benchmark(s) {', '.join(unknown)}; choose from {BENCHES}",
              file=sys.stderr)
        return 2
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    failed = []
    for name in names:
        print(f"== bench_{name}.py -> {out / (name + '.json')}", flush=True)
        start = time.perf_counter()
        rc = subprocess.call([sys.executable, str(HERE / f"bench_{name}.py"),
                              "--json", str(out / f"{name}.json")], env=env)
        print(f"== bench_{name}.py: exit {rc}, {time.perf_counter() - start:.0f} s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        print(f"run_all: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
