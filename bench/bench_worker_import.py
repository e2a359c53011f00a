"""CPU cost of a Megatron worker's start-up on a CPU machine: `enable_cpu_megatron()` (which
imports megatron.core) and `import megatron.training`, in fresh processes, as every torchrun
worker of the tests, the demo and `--cpu` launches pays it.

With --baseline DIR (a directory holding another version's `megatron_omnibal` package, e.g.
`git archive REV megatron_omnibal | tar -x -C DIR`), the two versions run alternately, one
process at a time, so that both see the same machine; the figure to read is their ratio.
Each process runs with its version's directory first on sys.path and checks that it imported
that version. CPU seconds are the child's user + system time (resource.RUSAGE_CHILDREN).

    .venv/bin/python bench/bench_worker_import.py [--baseline DIR] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
import megatron_omnibal
assert megatron_omnibal.__file__.startswith(sys.argv[1]), megatron_omnibal.__file__
from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron
enable_cpu_megatron()
import megatron.training
"""


def one_run(root: Path) -> float:
    """CPU seconds of one fresh process importing what a worker imports, from `root`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
           "PYTHONWARNINGS": "ignore"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", CHILD, str(root)], capture_output=True,
                          text=True, env=env, cwd=root)  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"worker import from {root} failed:\n{proc.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="a directory holding another version's megatron_omnibal package")
    parser.add_argument("--repeats", type=int, default=3, help="processes per version")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    versions = {"this": ROOT}
    if args.baseline is not None:
        if not (args.baseline / "megatron_omnibal" / "__init__.py").is_file():
            parser.error(f"--baseline {args.baseline}: no megatron_omnibal package in it")
        versions["baseline"] = args.baseline.resolve()
    runs: dict[str, list[float]] = {name: [] for name in versions}
    for _ in range(args.repeats):
        for name, root in versions.items():
            runs[name].append(one_run(root))
    figures = {name: {"cpu_s": values, "median_cpu_s": statistics.median(values)}
               for name, values in runs.items()}  # fmt: skip
    for name, f in figures.items():
        shown = ", ".join(f"{v:.2f}" for v in f["cpu_s"])
        print(f"{name:>9}: median {f['median_cpu_s']:.2f} CPU s ({shown})")
    if "baseline" in figures:
        ratio = figures["this"]["median_cpu_s"] / figures["baseline"]["median_cpu_s"]
        figures["ratio"] = ratio
        print(f"this / baseline: {ratio:.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
