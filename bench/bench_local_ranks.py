"""CPU cost of starting N local CPU ranks of a Megatron program: torchrun (every rank a fresh
interpreter that imports torch and megatron-core) against megatron/runtime/local_ranks.py (one
interpreter imports them, the ranks are forked from it), side by side, alternating one launch
at a time so that both see the same machine.

The program is what every CPU rank of `omnibal convert`, `compare-hf` and the Megatron tests
does first: `enable_cpu_megatron()`, `import megatron.training`, a gloo process group and one
all-reduce. CPU seconds are the launch's user + system time over all its processes
(resource.RUSAGE_CHILDREN). The figure to read is the ratio per rank count.

    .venv/bin/python bench/bench_local_ranks.py [--ranks 2,4] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_omnibal.megatron.runtime import local_ranks  # noqa: E402

PROGRAM = """
import torch
from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron
enable_cpu_megatron()
import megatron.training
import torch.distributed as dist
dist.init_process_group("gloo")
x = torch.ones(1)
dist.all_reduce(x)
assert x.item() == dist.get_world_size()
dist.destroy_process_group()
"""


def launch(cmd: list[str]) -> tuple[float, float]:
    """(CPU s over all processes, wall s) of one launch; it must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
           "PYTHONWARNINGS": "ignore"}  # fmt: skip
    start = os.times().elapsed
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = os.times().elapsed - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed:\n{proc.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="rank counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="launches per launcher and count")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    counts = [int(x) for x in args.ranks.split(",")]
    if args.repeats < 1 or min(counts) < 1:
        parser.error("--repeats and every rank count must be >= 1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "rank.py"
        program.write_text(PROGRAM)
        for n in counts:
            cmds = {
                "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc-per-node={n}", str(program)],
                "local_ranks": local_ranks.command(n, [str(program)]),
            }  # fmt: skip
            got: dict[str, list[tuple[float, float]]] = {name: [] for name in cmds}
            for _ in range(args.repeats):
                for name, cmd in cmds.items():
                    got[name].append(launch(cmd))
            row = {"ranks": n}
            for name, runs in got.items():
                row[f"{name}_cpu_s"] = statistics.median(c for c, _ in runs)
                row[f"{name}_wall_s"] = statistics.median(w for _, w in runs)
            row["cpu_ratio"] = row["local_ranks_cpu_s"] / row["torchrun_cpu_s"]
            rows.append(row)
            print(f"{n} ranks: torchrun {row['torchrun_cpu_s']:.2f} CPU s "
                  f"({row['torchrun_wall_s']:.2f} s wall), local_ranks "
                  f"{row['local_ranks_cpu_s']:.2f} CPU s ({row['local_ranks_wall_s']:.2f} s "
                  f"wall): {row['cpu_ratio']:.2f}x the CPU (median of {args.repeats})",
                  flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"repeats": args.repeats, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
