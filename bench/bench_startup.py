"""Start-up of a training job with many ranks per node: time from launch to the first step's
data and memory per rank and per node, the node-shared epoch plan against every rank balancing
its own.

8 local ranks (torchrun, gloo, CPU, one thread each; TP 1, PP 1, DP 8) run the entry point's
real start-up code (`pretrain_vlm.prepare`: Megatron's parse of the completed command line,
every check, the settings with the length file loaded and converted, the resume plan; then the
iteration log's stream and this rank's balanced iterator, as `train` and Megatron's data
provider build them) on the shipped real lengths replicated to `--samples` (each copy its own
datasets, as bench_balance's scaling builds them), InternVL-6B+20B shapes, budgets 18 tiles /
6,016 tokens, 8 micro-batches per rank and step, synthetic samples; each rank stops once it
holds its first step's micro-batches (no model is built). Side by side:

  node    the product: the node's local rank 0 reads the lengths and balances the epoch and
          writes both, the other ranks map them read-only (megatron/stream/node_plans.py)
  today   the code path before: every rank reads the lengths and balances the epoch itself,
          through the same public functions (each rank told it is its node's only one, the
          sampler without node plans), reachable only from this benchmark

and, for reference, one balance() of the same epoch in a fresh process (the length file loaded,
then balanced): its wall time and peak RSS are the goals' yardstick (time to the first batch
within 1.3x of it; node memory within 1.3x of it plus a small cost per rank).

Memory: per rank, the peak RSS (ru_maxrss: counts every mapped page it touched, also the pages
the ranks share); per node, the peak over time of the summed PSS of the 8 ranks (proportional
set size: a page shared by k ranks counts 1/k in each, so the mapped plan counts once), sampled
every 0.2 s from /proc/PID/smaps_rollup by this process. Time: wall seconds from the launch of
torchrun to the last rank holding its first step's data.

With --record-index SIZES (e.g. 1M,3M) it measures instead what one rank holds to find a
real data source's records: an InternVL-style JSONL annotation file of each size (an image path
and a two-turn conversation per line, about 300 bytes) is indexed in a fresh process, side by
side, as today's list of (dataset, record) pairs (every line's text held, the code path
before) and as the record index (megatron/stream/record_index.py: dataset and place per sample
over the file's byte offsets): CPU s to build it, the memory it holds (RSS after minus before),
the peak RSS, bytes per record, and how the held memory grows per 10x records. Then, at the
largest size, a node: --ranks local ranks each building its own index, against the node
building it once (local rank 0) and the other ranks mapping it (the product's path):
CPU s summed over the ranks and the node's held PSS (a shared page counted once).

    .venv/bin/python bench/bench_startup.py [--samples 12M] [--ranks 8] [--modes node,today]
        [--work-dir DIR] [--json PATH]
    .venv/bin/python bench/bench_startup.py --record-index 1M,3M [--work-dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_balance import EXAMPLE, parse_sizes  # noqa: E402

MODES = ("node", "today")
BUDGETS = (18, 6016)
MICRO_BATCHES = 8
SAMPLE_S = 0.2


def build_lengths(samples: int, folder: Path) -> Path:
    """The shipped real lengths replicated to about `samples` (each copy its own datasets), with
    the example's stats configuration (counted at the model's tokens per tile)."""
    from megatron_omnibal.data.lengths import concat, load_lengths, read_stats_config, save_lengths

    real = load_lengths(EXAMPLE)
    copies = max(1, round(samples / len(real)))
    path = folder / f"lengths_{copies}x.npz"
    if not path.is_file():
        save_lengths(concat([real] * copies), path, config=read_stats_config(EXAMPLE))
    return path


def training_flags(lengths: Path, ranks: int) -> list[str]:
    return [
        "--omnibal", "--omnibal-model", "internvl-6b-20b", "--omnibal-lengths", str(lengths),
        "--omnibal-vit-pp-layers", "45", "--omnibal-llm-pp-layers", "48",
        "--omnibal-vit-budget", str(BUDGETS[0]), "--omnibal-token-budget", str(BUDGETS[1]),
        "--micro-batch-size", "1", "--global-batch-size", str(ranks * MICRO_BATCHES),
        "--train-iters", "1", "--lr", "1e-4", "--seed", "1", "--transformer-impl", "local",
    ]  # fmt: skip


def worker(mode: str, out: Path, flags: list[str]) -> None:
    """One rank: the real start-up up to its first step's data, then its peak RSS."""
    from megatron_omnibal.megatron.runtime.compat import ensure_typing_override
    from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron
    from megatron_omnibal.megatron.runtime.notes import quiet_fallback_warnings
    from megatron_omnibal.megatron.training import pretrain_vlm

    quiet_fallback_warnings()  # as pretrain_vlm.main starts
    enable_cpu_megatron()
    ensure_typing_override()
    if mode == "today":  # each rank its own node's only rank: it reads the lengths itself
        os.environ["LOCAL_WORLD_SIZE"] = "1"
    _, settings, spec, resume, source = pretrain_vlm.prepare(flags)
    plans = pretrain_vlm.node_plans(settings, resume) if mode == "node" else None
    pretrain_vlm._install_iteration_log(settings, resume, spec, plans)
    ranks = pretrain_vlm.StageRanks(dp=settings.rank, pp=0, tp=0, model_size=1)
    iterator, _ = pretrain_vlm.data_iterator(
        settings, spec, ranks, 0, origin=resume.origin, plans=plans, source=source
    )
    first = [next(iterator) for _ in range(iterator.micro_batches_of_next_step())]
    done = time.time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    (out / f"rank{settings.rank}.json").write_text(
        json.dumps({"done": done, "peak_rss": peak, "micro_batches": len(first)})
    )


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def launch(mode: str, ranks: int, lengths: Path, out: Path) -> dict:
    """torchrun with `ranks` local ranks of this file's worker; its figures."""
    import psutil

    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", __file__, "--worker", mode, str(out),
           *training_flags(lengths, ranks)]  # fmt: skip
    start = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    node_peak, rank_peak = 0, {}
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            workers = [p for p in parent.children(recursive=True) if "--worker" in p.cmdline()]
        except psutil.Error:
            workers = []
        sizes = {p.pid: _pss(p.pid) for p in workers}
        node_peak = max(node_peak, sum(sizes.values()))
        for pid, size in sizes.items():
            rank_peak[pid] = max(rank_peak.get(pid, 0), size)
        time.sleep(SAMPLE_S)
    _, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{mode}: torchrun failed ({proc.returncode}):\n{err[-3000:]}")
    done = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    return {
        "mode": mode,
        "first_batch_s": max(d["done"] for d in done) - start,
        "rank_peak_rss_gb": max(d["peak_rss"] for d in done) / 1e9,
        "rank_peak_pss_gb": max(rank_peak.values(), default=0) / 1e9,
        "node_peak_pss_gb": node_peak / 1e9,
    }


ONE_BALANCE = """
import json, resource, sys, time
start = time.perf_counter()
sys.path.insert(0, sys.argv[1])
from megatron_omnibal.balance.balancer import balance
from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.data.lengths import load_lengths
lengths = load_lengths(sys.argv[2])
plan = balance(lengths, BalanceConfig(dp_size=int(sys.argv[3]), micro_batches=int(sys.argv[4]),
                                      vit_budget=int(sys.argv[5]), token_budget=int(sys.argv[6]),
                                      seed=1))
nbytes = sum(getattr(plan, k).nbytes for k in ("samples", "pack_ptr", "pack_step", "pack_rank",
                                               "pack_micro", "skipped", "pack_level"))
print(json.dumps({"wall_s": time.perf_counter() - start, "samples": len(lengths),
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                  "plan_gb": nbytes / 1e9}))
"""


def one_balance(ranks: int, lengths: Path) -> dict:
    """One balance() of the same epoch in a fresh process: wall s (import, load, balance) and
    peak RSS, and the plan's size."""
    proc = subprocess.run(
        [sys.executable, "-c", ONE_BALANCE, str(ROOT), str(lengths), str(ranks),
         str(MICRO_BATCHES), *map(str, BUDGETS)],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"one balance() failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# One record index in a fresh process (argv: project root, annotation file, list|index): its
# figures as JSON, with the ids of three records read back through it.
RECORD_CHILD = """
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from megatron_omnibal.data.formats.annotations import DatasetSpec
from megatron_omnibal.data.formats.raw import parse_record
from megatron_omnibal.megatron.stream.record_index import RecordIndex
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
path = Path(sys.argv[2])
spec = DatasetSpec(path.stem, path, path.parent)
before, cpu = rss(), time.process_time()
if sys.argv[3] == "list":  # the code path before: (dataset, record) per length record
    entries = [(0, r) for r in spec.records() if r.index not in ()]
else:
    entries = RecordIndex.build([spec.record_table()], [spec.repeats], {})
cpu = time.process_time() - cpu
held = rss() - before
n = len(entries)
ids = [parse_record(entries[i][1])["id"] for i in (0, n // 2, n - 1)]
print(json.dumps({"records": n, "cpu_s": cpu, "held_gb": held / 1e9,
                  "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
                  "bytes_per_record": held / n, "ids": ids}))
"""
RECORD_LINE = ('{{"id": {k}, "image": "coco/train2017/{k:012d}.jpg", "conversations": '
               '[{{"from": "human", "value": "<image>\\nWhat is the person in the picture '
               'holding, and what is it for?"}}, {{"from": "gpt", "value": "The person holds '
               'a tennis racket ({k}), ready to return the ball across the net on a clay '
               'court."}}]}}\n')


def annotation_file(lines: int, folder: Path) -> Path:
    """An InternVL-style JSONL file of `lines` records (written once, kept in `folder`)."""
    path = folder / f"annotations_{lines}.jsonl"
    if not path.is_file():
        part = path.with_suffix(".part")
        with open(part, "w") as fh:
            for start in range(0, lines, 100_000):
                fh.write("".join(RECORD_LINE.format(k=k)
                                 for k in range(start, min(start + 100_000, lines))))
        part.rename(path)
    return path


def record_index(sizes: list[int], folder: Path) -> list[dict]:
    """Per size and way (list, index): the child's figures; growth per 10x records."""
    rows = []
    for lines in sizes:
        path = annotation_file(lines, folder)
        for way in ("list", "index"):
            proc = subprocess.run([sys.executable, "-c", RECORD_CHILD, str(ROOT), str(path), way],
                                  capture_output=True, text=True)
            if proc.returncode:
                raise SystemExit(f"record index ({way}, {lines}) failed:\n{proc.stderr[-2000:]}")
            row = {"way": way, "file_gb": path.stat().st_size / 1e9,
                   **json.loads(proc.stdout.strip().splitlines()[-1])}
            if row["ids"] != [0, lines // 2, lines - 1]:
                raise SystemExit(f"record index ({way}, {lines}): read back {row['ids']}")
            prev = next((r for r in reversed(rows) if r["way"] == way), None)
            if prev:
                row["held_per_10x"] = (row["held_gb"] / prev["held_gb"]) ** (
                    1 / math.log10(row["records"] / prev["records"]))
            rows.append(row)
    print("record index of one rank: an InternVL-style JSONL file, today's list of (dataset, "
          "record) pairs against the record index")
    print(f"{'records':>12}{'file GB':>9}{'way':>7}{'CPU s':>8}{'held GB':>9}{'peak GB':>9}"
          f"{'B/record':>10}{'held x/10x':>12}")
    for r in rows:
        growth = f"{r['held_per_10x']:>12.1f}" if "held_per_10x" in r else ""
        print(f"{r['records']:>12,}{r['file_gb']:>9.2f}{r['way']:>7}{r['cpu_s']:>8.2f}"
              f"{r['held_gb']:>9.3f}{r['peak_rss_gb']:>9.2f}{r['bytes_per_record']:>10.1f}"
              f"{growth}")
    for lines in sizes:
        old, new = (next(r for r in rows if r["records"] == lines and r["way"] == w)
                    for w in ("list", "index"))
        print(f"{lines:,} records: list / index held memory {old['held_gb'] / new['held_gb']:.1f}x,"
              f" build CPU {old['cpu_s'] / new['cpu_s']:.2f}x")
    return rows


# One local rank of a node finding its records (argv: project root, annotation file,
# ranks|node, a fresh folder): `ranks` builds the index itself, `node` through
# node_plans.node_arrays (local rank 0 builds, the others map). Once every rank holds its
# index, each reads its PSS (the node's sum counts a shared page once); JSON on stdout.
NODE_CHILD = """
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from megatron_omnibal.data.formats.annotations import DatasetSpec
from megatron_omnibal.data.formats.raw import parse_record
from megatron_omnibal.megatron.stream.node_plans import node_arrays
from megatron_omnibal.megatron.stream.record_index import RecordIndex
path, way, folder = Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
rank, ranks = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
spec = DatasetSpec(path.stem, path, path.parent)
def build():
    return RecordIndex.build([spec.record_table()], [spec.repeats], {})
def barrier(name):
    (folder / f"{name}{rank}").touch()
    while sum(1 for f in folder.iterdir() if f.name.startswith(name)) < ranks:
        time.sleep(0.02)
def pss_gb():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024 / 1e9
before, cpu = pss_gb(), time.process_time()
if way == "node":
    arrays, meta = node_arrays(lambda: build().to_arrays(), "record-index", {"bench": 1},
                               local_rank=rank, folder=folder)
    entries = RecordIndex.from_arrays(arrays, meta, lambda d: spec.record_table())
else:
    entries = build()
cpu = time.process_time() - cpu
n = len(entries)
ids = [parse_record(entries[i][1])["id"] for i in (0, n // 2, n - 1)]
sum(int(a.sum()) for a in (entries.dataset, entries.row, entries.tables[0].starts))  # all read
barrier("held")
held = pss_gb() - before
barrier("measured")
print(json.dumps({"cpu_s": cpu, "held_pss_gb": held, "ids": ids}))
"""


def record_index_node(lines: int, ranks: int, folder: Path) -> list[dict]:
    """`ranks` local ranks finding the records of one annotation file, each building its own
    index against the node building it once: CPU s summed over the ranks, node PSS held."""
    from megatron_omnibal.megatron.stream.node_plans import default_folder

    path = annotation_file(lines, folder)
    rows = []
    for way in ("ranks", "node"):
        shared = Path(tempfile.mkdtemp(prefix="omnibal-bench-", dir=default_folder()))
        try:
            env = {**os.environ, "LOCAL_WORLD_SIZE": str(ranks),
                   "TORCHELASTIC_RUN_ID": f"bench{os.getpid()}"}
            procs = [subprocess.Popen(
                [sys.executable, "-c", NODE_CHILD, str(ROOT), str(path), way, str(shared)],
                env={**env, "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True) for r in range(ranks)]
            said = [p.communicate() for p in procs]
        finally:
            shutil.rmtree(shared, ignore_errors=True)
        if any(p.returncode for p in procs):
            raise SystemExit(f"record index of a node ({way}) failed:\n"
                             + "\n".join(err[-1500:] for _, err in said))
        got = [json.loads(out.strip().splitlines()[-1]) for out, _ in said]
        if any(g["ids"] != [0, lines // 2, lines - 1] for g in got):
            raise SystemExit(f"record index of a node ({way}): read back {got}")
        rows.append({"way": way, "records": lines, "ranks": ranks,
                     "cpu_s": sum(g["cpu_s"] for g in got),
                     "node_held_gb": sum(g["held_pss_gb"] for g in got)})
    print(f"\nrecord index of a node: {ranks} local ranks, {lines:,} records, every rank "
          "building its own against the node building it once")
    print(f"{'way':>7}{'CPU s, all ranks':>18}{'node PSS held GB':>18}")
    for r in rows:
        print(f"{r['way']:>7}{r['cpu_s']:>18.2f}{r['node_held_gb']:>18.3f}")
    mine, node = rows
    print(f"ranks / node: CPU {mine['cpu_s'] / node['cpu_s']:.1f}x, node memory "
          f"{mine['node_held_gb'] / node['node_held_gb']:.1f}x")
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        worker(argv[1], Path(argv[2]), argv[3:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", default="12M", help="length file size, e.g. 1.2M, 12M")
    parser.add_argument("--ranks", type=int, default=8, help="local ranks (DP size)")
    parser.add_argument("--modes", default="node,today", help="node, today or both")
    parser.add_argument("--work-dir", default=str(ROOT / "bench" / "results" / "startup"))
    parser.add_argument("--json", help="write the figures as JSON")
    parser.add_argument("--record-index", metavar="SIZES",
                        help="measure the record index at these annotation sizes instead")
    args = parser.parse_args(argv)
    if args.record_index:
        folder = Path(args.work_dir)
        folder.mkdir(parents=True, exist_ok=True)
        sizes = parse_sizes(args.record_index)
        rows = record_index(sizes, folder)
        node = record_index_node(sizes[-1], args.ranks, folder)
        if args.json:
            Path(args.json).write_text(json.dumps({"record_index": rows,
                                                   "record_index_node": node}, indent=2))
        return 0
    modes = [m.strip() for m in args.modes.split(",")]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)} (choose from {', '.join(MODES)})")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    lengths = build_lengths(parse_sizes(args.samples)[0], work)
    reference = one_balance(args.ranks, lengths)
    print(f"{reference['samples']:,} samples, {args.ranks} local ranks, budgets "
          f"{BUDGETS[0]}/{BUDGETS[1]}, {MICRO_BATCHES} micro-batches per rank and step")
    print(f"one balance() in a fresh process: {reference['wall_s']:.1f} s, peak RSS "
          f"{reference['peak_rss_gb']:.2f} GB (the plan's arrays {reference['plan_gb']:.2f} GB)")
    rows = [launch(mode, args.ranks, lengths, work / mode) for mode in modes]
    print(f"{'':<8}{'first batch s':>15}{'x balance':>11}{'rank RSS GB':>13}{'rank PSS GB':>13}"
          f"{'node PSS GB':>13}{'x balance':>11}{'per rank GB':>13}")
    for r in rows:
        r["time_vs_balance"] = r["first_batch_s"] / reference["wall_s"]
        r["node_vs_balance"] = r["node_peak_pss_gb"] / reference["peak_rss_gb"]
        r["node_above_balance_per_rank_gb"] = (
            r["node_peak_pss_gb"] - reference["peak_rss_gb"]) / args.ranks
        print(f"{r['mode']:<8}{r['first_batch_s']:>15.1f}{r['time_vs_balance']:>11.2f}"
              f"{r['rank_peak_rss_gb']:>13.2f}{r['rank_peak_pss_gb']:>13.2f}"
              f"{r['node_peak_pss_gb']:>13.2f}{r['node_vs_balance']:>11.2f}"
              f"{r['node_above_balance_per_rank_gb']:>13.3f}")
    if len(rows) == 2:
        node, today = rows
        print(f"today / node: first batch {today['first_batch_s'] / node['first_batch_s']:.2f}x, "
              f"node memory {today['node_peak_pss_gb'] / node['node_peak_pss_gb']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"samples": reference["samples"], "ranks": args.ranks, "one_balance": reference,
             "runs": rows}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
