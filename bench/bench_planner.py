"""Planner bench: headline speedups, the OmniBal ablation on the modelled 6+20B and 6+34B, and
search times.

Everything here is predicted by the planner's FLOPs cost model and pipeline simulator from
real sample lengths (the shipped InternVL subset); nothing is measured on GPUs.

The headline (`omnibal plan`'s first line) compares the plan with the best configuration a
Megatron-LM user could set by hand for the same model, GPUs and global batch (TP, PP,
micro-batch size, --decoder-first/last-pipeline-num-layers, --recompute-vision,
--recompute-num-layers and the interleaved schedule searched; ViT on stage 0; padded
fixed-size batches; only what fits). `--worth-only` prints only what each choice of the
baseline and of the plan is worth on four presets (`choices_worth`).

The ablation keeps one parallel configuration and adds the three balances one at a time:

  baseline     Megatron layout (ViT + projector on stage 0, LLM split evenly), every layer
               recomputed, random fixed-size micro-batches padded to their longest sample
  +data        the same, on balanced micro-batches (vision and token budgets)
  +partition   the exact searched partition, still recomputing every layer
  +recompute   partition searched jointly with per-stage recompute under the memory budget

Usage: python bench/bench_planner.py [--gpus 128] [--hardware A100-80G] [--worth-only]
                                     [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from megatron_omnibal.data.lengths import load_lengths  # noqa: E402
from megatron_omnibal.models.presets import get_preset  # noqa: E402
from megatron_omnibal.planner.cost_model.hardware import get_hardware  # noqa: E402
from megatron_omnibal.planner.make import make_plan  # noqa: E402
from megatron_omnibal.planner.search.parallel_search import plan_candidates  # noqa: E402
from megatron_omnibal.planner.search.partition import search  # noqa: E402
from megatron_omnibal.planner.search.request import PlanRequest  # noqa: E402
from megatron_omnibal.planner.search.setting import (  # noqa: E402
    budget_mib,
    choose_partition,
    make_setting,
)

WORTH_PRESETS = ("internvl-6b-20b", "llava-1.5-7b", "internvl-6b-34b", "internvl2-8b")
PAPER_GPU_DAYS = {"internvl-6b-20b": [61.8, 51.9, 29.0, 21.3]}  # OmniBal (ICML 2025) ablation
EPOCH_SAMPLES = 70_706 * 17  # the 1.2M-record replicate of the shipped subset


def ablation_rows(setting, hw, gpus: int, global_batch: int) -> list[dict]:
    """The four ablation rows on one fixed configuration."""
    rows = []
    steps = [
        ("baseline", "megatron", setting.fixed, True),
        ("+data", "megatron", setting.balanced, True),
        ("+partition", "exact", setting.balanced, False),
        ("+recompute", "exact", setting.balanced, True),
    ]
    for label, mode, feats, recompute in steps:
        part, _ = choose_partition(setting, mode, feats, recompute=recompute)
        res = setting.predict(part, feats)
        peak = float(part.memory_mib.max())
        gpu_days = EPOCH_SAMPLES / global_batch * res.step_ms * gpus / 86_400e3
        rows.append(
            {
                "step": label,
                "step_ms": round(res.step_ms, 1),
                "bubble": round(res.bubble_fraction, 4),
                "gpu_days": round(gpu_days, 2),
                "stage0_units": part.bounds[1],
                "peak_gib": round(peak / 1024, 1),
                "fits": peak <= budget_mib(hw) + 1e-6,
            }
        )
    return rows


def request(name: str, hw_name: str, gpus: int, stats, global_batch: int = 1024, **kw):
    return PlanRequest(model=get_preset(name), hardware=get_hardware(hw_name), lengths=stats,
                       gpus=gpus, global_batch=global_batch, **kw)  # fmt: skip


def headline(names, hw_name: str, gpus: int, stats, global_batch: int) -> list[dict]:
    """`omnibal plan`'s headline: the plan against the best hand-set Megatron-LM configuration,
    and the same-sizes Megatron layout (the old comparison) beside it."""
    out = []
    for name in names:
        t0, c0 = time.perf_counter(), time.process_time()
        plan = make_plan(request(name, hw_name, gpus, stats, global_batch))
        p, par = plan.predicted, plan.parallel
        b = p.baseline
        out.append(
            {
                "model": name,
                "plan": {"tp": par.tp, "pp": par.pp, "dp": par.dp, "m": par.micro_batches,
                         "vpp": par.vpp, "step_ms": p.step_ms},
                "baseline": None if b is None else {
                    "tp": b.tp, "pp": b.pp, "dp": b.dp, "micro_batch_size": b.micro_batch_size,
                    "llm_layers": list(b.llm_layers_per_stage),
                    "recompute_vision": b.recompute_vision,
                    "recompute_num_layers": b.recompute_num_layers, "vpp": b.vpp,
                    "step_ms": b.step_ms,
                    "configurations_searched": b.configurations_searched,
                    "configurations_fitting": b.configurations_fitting,
                },
                "speedup": p.speedup,
                "same_parallel_speedup": p.same_parallel.speedup,
                "same_parallel_fits": p.same_parallel.fits_memory,
                "plan_cpu_s": round(time.process_time() - c0, 2),
                "plan_wall_s": round(time.perf_counter() - t0, 2),
            }
        )  # fmt: skip
    return out


def ablation(name: str, hw_name: str, gpus: int, stats, global_batch: int) -> dict:
    """Ablation at PP 4, 8, 16 (tp=1, 4 micro-batches per stage) and at the planner's pick."""
    hw = get_hardware(hw_name)
    req = request(name, hw_name, gpus, stats, global_batch)
    t0, c0 = time.perf_counter(), time.process_time()
    ranked = plan_candidates(req)
    search = {
        "wall_s": round(time.perf_counter() - t0, 2),
        "cpu_s": round(time.process_time() - c0, 2),
    }
    best = ranked[0].setting
    configs = [(1, pp, 4 * pp) for pp in (4, 8, 16)]
    if (best.tp, best.pp, best.m) not in configs:
        configs.append((best.tp, best.pp, best.m))
    out = []
    for tp, pp, m in configs:
        setting = make_setting(req, tp, pp, gpus // (tp * pp), m)
        out.append(
            {
                "tp": tp,
                "pp": pp,
                "dp": setting.dp,
                "m": m,
                "vit_budget": setting.vit_budget,
                "token_budget": setting.token_budget,
                "planner_choice": (tp, pp, m) == (best.tp, best.pp, best.m),
                "rows": ablation_rows(setting, hw, gpus, global_batch),
            }
        )
    ranking = [
        {
            "tp": e.setting.tp,
            "pp": e.setting.pp,
            "dp": e.setting.dp,
            "m": e.setting.m,
            "step_ms": round(e.result.step_ms, 1),
        }
        for e in ranked
    ]
    return {
        "model": name,
        "hardware": hw_name,
        "gpus": gpus,
        "parallel_search": search,
        "ranking": ranking,
        "configs": out,
    }


def optimality_check(stats, gpus: int, hw_name: str, pps: tuple[int, ...] = (3, 4)) -> list:
    """Search vs the true optimum on the full-size 6+20B, exhaustively (PP 3 and 4).

    Every split is scored by the exact 1F1B lower bound max_s(work before s + m t_s); only
    splits whose bound is below the searched step can beat it, and those are all simulated.
    """
    hw, req = get_hardware(hw_name), request("internvl-6b-20b", hw_name, gpus, stats)
    out = []
    for pp in pps:
        setting = make_setting(req, 1, pp, gpus // pp, 4 * pp)
        problem = setting.problem(budget_mib(hw))
        found = search(problem, pp)
        tables, units = problem.tables(pp), problem.units
        cuts = np.array(list(itertools.combinations(range(1, units), pp - 1)))
        n = len(cuts)
        b = np.concatenate([np.zeros((n, 1), int), cuts, np.full((n, 1), units)], axis=1)
        t = np.stack([tables[k][b[:, k], b[:, k + 1]] for k in range(pp)], axis=1)
        feasible = np.all(np.isfinite(t), axis=1)
        edge = 2 * problem.p2p[b[:, :-1]]
        prefix = np.concatenate([np.zeros((n, 1)), np.cumsum(t + edge, axis=1)[:, :-1]], axis=1)
        bound = np.max(prefix + problem.m * t, axis=1)
        rivals = np.flatnonzero(feasible & (bound < found.step_ms))
        best = min([found.step_ms] + [problem.evaluate(tuple(b[i])).step_ms for i in rivals])
        out.append(
            {
                "pp": pp,
                "m": problem.m,
                "splits": int(n),
                "fit_memory": int(feasible.sum()),
                "simulated": int(len(rivals)),
                "search_step_ms": round(found.step_ms, 3),
                "optimum_step_ms": round(best, 3),
                "gap": found.step_ms / best - 1,
            }
        )
    return out


def certificates(stats, gpus: int, hw_name: str) -> list[dict]:
    """Certified search on the full-size 6+20B at PP 4, 8, 16 and 2 or 4 micro-batches per
    stage: the DPs + polish alone (tolerance None) against the branch and bound, and the
    proven gap of the result (step / lower bound - 1)."""
    hw, req = get_hardware(hw_name), request("internvl-6b-20b", hw_name, gpus, stats)
    out = []
    for pp, per in itertools.product((4, 8, 16), (2, 4)):
        setting = make_setting(req, 1, pp, gpus // pp, per * pp)
        problem = setting.problem(budget_mib(hw))
        c0 = time.process_time()
        fast = search(problem, pp, tolerance=None)
        c1 = time.process_time()
        full = search(problem, pp)
        c2 = time.process_time()
        out.append(
            {
                "pp": pp,
                "m": problem.m,
                "dp_polish_step_ms": round(fast.step_ms, 3),
                "dp_polish_cpu_s": round(c1 - c0, 3),
                "certified_step_ms": round(full.step_ms, 3),
                "lower_bound_ms": round(full.lower_bound_ms, 3),
                "proven_gap": full.step_ms / full.lower_bound_ms - 1,
                "dp_polish_excess": fast.step_ms / full.step_ms - 1,
                "certified_cpu_s": round(c2 - c1, 3),
            }
        )
    return out


def interleaved_steps(stats, gpus: int, hw_name: str) -> list[dict]:
    """The certified plan at fixed sizes (6+20B, TP 1, m = 4 x PP) with 1, 2 and 4 model
    chunks per rank: step on the balanced micro-batches, CPU seconds, proven gap."""
    req = request("internvl-6b-20b", hw_name, gpus, stats)
    out = []
    for pp in (4, 8, 16):
        setting = make_setting(req, 1, pp, gpus // pp, 4 * pp)
        row = {"pp": pp, "m": 4 * pp}
        for vpp in (1, 2, 4):
            c0 = time.process_time()
            part, _ = choose_partition(setting, "exact", vpp=vpp)
            row[f"vpp{vpp}"] = {
                "step_ms": round(setting.predict(part, setting.balanced).step_ms, 1),
                "cpu_s": round(time.process_time() - c0, 2),
                "proven_gap": round(part.step_ms / part.lower_bound_ms - 1, 4),
                "peak_gib": round(float(part.memory_mib.max()) / 1024, 1),
            }
        out.append(row)
    return out


BASELINE_CHOICES = (
    ("all of them", {}),
    ("without interleaving (1F1B only)", {"interleave": False}),
    ("without uneven first/last stages", {"uneven": False}),
    ("without recompute flags", {"recompute": False}),
    ("without micro-batch sizes > 1", {"micro_batch_sizes": False}),
)


def choices_worth(
    names, hw_name: str, gpus: int, stats, global_batch: int, show: bool = False
) -> list[dict]:
    """What each choice is worth, in modeled step time, on each preset.

    Baseline: the best hand-set Megatron-LM configuration with all of its choices, and again
    with each one taken away (searched again without it). Ours: the plan with virtual stages
    searched (`--vpp auto`) and, at its configuration, each of our choices taken away: the
    interleaved schedule (the best 1F1B plan, searched again), balanced data (the same split
    on the baseline's fixed-size padded micro-batches), the searched split (Megatron's LLaVA
    split with the cheapest recompute that fits, 1F1B), per-stage recompute (every layer
    recomputed, split searched again). A value is the step without the choice over the step
    with all of them: what the choice is worth.
    """
    from megatron_omnibal.planner.search.baseline import best_megatron_baseline
    from megatron_omnibal.planner.search.partition import megatron_default

    hw = get_hardware(hw_name)
    out = []
    for name in names:
        req = request(name, hw_name, gpus, stats, global_batch, vpp=None)
        baseline = []
        for label, kw in BASELINE_CHOICES:
            found = best_megatron_baseline(req, **kw).best
            baseline.append(
                {
                    "without": label,
                    "step_ms": None if found is None else round(found.result.step_ms, 1),
                    "config": None if found is None else describe_baseline(found.config),
                }
            )
        best = plan_candidates(req)[0]
        st, part = best.setting, best.part
        one_f1b = plan_candidates(replace(req, vpp=1))[0]
        problem = st.problem(budget_mib(hw))
        plain = megatron_default(problem, st.pp, full_recompute=False)
        no_rec, _ = choose_partition(st, "exact", recompute=False, vpp=part.vpp)
        ours = [
            ("all of them", best.result.step_ms, True),
            ("without interleaving (best 1F1B plan)", one_f1b.result.step_ms, True),
            ("without balanced data", st.predict(part, st.fixed).step_ms, None),
            ("without the searched split", st.predict(plain, st.balanced).step_ms,
             problem.fits(plain)),
            ("without per-stage recompute", st.predict(no_rec, st.balanced).step_ms,
             bool(np.all(no_rec.memory_mib <= budget_mib(hw) + 1e-6))),
        ]  # fmt: skip
        out.append(
            {
                "model": name,
                "plan": f"tp{st.tp} pp{st.pp} dp{st.dp} m{st.m} vpp{part.vpp}",
                "plan_1f1b": f"tp{one_f1b.setting.tp} pp{one_f1b.setting.pp} "
                f"dp{one_f1b.setting.dp} m{one_f1b.setting.m}",
                "baseline": baseline,
                "ours": [
                    {"without": label, "step_ms": round(step, 1), "fits": fits}
                    for label, step, fits in ours
                ],
            }
        )
        if show:  # one preset at a time: the full table takes minutes
            print_worth(out[-1:])
            sys.stdout.flush()
    return out


def describe_baseline(c) -> str:
    rec = ("ViT + " if c.recompute_vision else "") + f"{c.recompute_num_layers} LLM layers"
    return (
        f"tp{c.tp} pp{c.pp} dp{c.dp} mbs{c.micro_batch_size} vpp{c.vpp} LLM "
        f"{'/'.join(map(str, c.llm_layers))}, recompute {rec}"
    )


def print_worth(rows: list[dict]) -> None:
    for row in rows:
        base = row["baseline"]
        full = base[0]["step_ms"]
        print(f"  {row['model']}: best baseline {base[0]['config']}: {full / 1000:.2f} s")
        for b in base[1:]:
            worth = "nothing fits" if b["step_ms"] is None else f"x{b['step_ms'] / full:.3f}"
            print(f"    baseline {b['without']:<38} {worth:>12}  ({b['config']})")
        ours = row["ours"]
        top = ours[0]["step_ms"]
        print(f"    plan {row['plan']}: {top / 1000:.2f} s (best 1F1B plan {row['plan_1f1b']})")
        for o in ours[1:]:
            fits = "" if o["fits"] is None else ("" if o["fits"] else "  (over memory)")
            print(f"    ours {o['without']:<42} x{o['step_ms'] / top:.3f}{fits}")


def plan_times(stats, gpus: int, hw_name: str) -> list[dict]:
    """Time of `make_plan` for 6+20B at fixed PP (tp=1), the issue's < 2 s target, and of the
    baseline search inside it (the same for every PP: it searches all sizes)."""
    from megatron_omnibal.planner.search.baseline import best_megatron_baseline

    out = []
    for pp in (2, 4, 8, 16):
        req = request("internvl-6b-20b", hw_name, gpus, stats, tp=1, pp=pp)
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            step = make_plan(req).predicted.step_ms
        except ValueError:  # too few stages to fit memory is an answer too, timed as well
            step = "infeasible (memory)"
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        c1 = time.process_time()
        best_megatron_baseline(req)
        out.append(
            {
                "pp": pp,
                "wall_s": round(wall, 3),
                "cpu_s": round(cpu, 3),
                "baseline_search_cpu_s": round(time.process_time() - c1, 3),
                "step_ms": step,
            }
        )
    return out


def print_report(report: dict) -> None:
    print("headline: the plan against the best hand-set Megatron-LM configuration that fits")
    for row in report["headline"]:
        p, b = row["plan"], row["baseline"]
        base = (
            "no Megatron-LM configuration fits memory"
            if b is None
            else f"best baseline tp={b['tp']} pp={b['pp']} vpp={b['vpp']} dp={b['dp']} mbs="
            f"{b['micro_batch_size']} LLM {'/'.join(map(str, b['llm_layers']))} recompute "
            f"vision={b['recompute_vision']} llm={b['recompute_num_layers']}: "
            f"{b['step_ms'] / 1000:.1f} s ({b['configurations_fitting']} of "
            f"{b['configurations_searched']} configurations fit)"
        )
        speed = "n/a" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        print(
            f"  {row['model']}: plan tp={p['tp']} pp={p['pp']} dp={p['dp']} m={p['m']} "
            f"{p['step_ms'] / 1000:.1f} s; {base}; speedup {speed} (same-sizes Megatron layout: "
            f"x{row['same_parallel_speedup']:.2f}, fits {row['same_parallel_fits']}); "
            f"plan {row['plan_cpu_s']} s CPU"
        )
    for ab in report["ablation"]:
        s = ab["parallel_search"]
        print(
            f"\n{ab['model']} on {ab['gpus']} x {ab['hardware']}: TP/PP/m search over "
            f"{len(ab['ranking'])} feasible configs in {s['cpu_s']} s CPU ({s['wall_s']} s wall)"
        )
        print(
            "  ranking: "
            + "; ".join(
                f"pp={o['pp']} dp={o['dp']} m={o['m']} {o['step_ms'] / 1000:.1f} s"
                for o in ab["ranking"][:5]
            )
        )
        paper = PAPER_GPU_DAYS.get(ab["model"])
        for cfg in ab["configs"]:
            pick = "  <- planner's choice" if cfg["planner_choice"] else ""
            print(
                f"  tp={cfg['tp']} pp={cfg['pp']} dp={cfg['dp']} m={cfg['m']} budgets "
                f"{cfg['vit_budget']} tiles / {cfg['token_budget']} tokens{pick}"
            )
            print(
                f"    {'step':<11} {'step s':>7} {'bubble':>7} {'GPU-days':>9} {'rel':>5} "
                f"{'paper':>6} {'rel':>5} {'stage0 units':>12} {'peak GiB':>8} fits"
            )
            base = cfg["rows"][0]["gpu_days"]
            for i, row in enumerate(cfg["rows"]):
                ref = (
                    f"{paper[i]:>6.1f} {paper[i] / paper[0]:>5.2f}"
                    if paper
                    else f"{'n/a':>6} {'':>5}"
                )
                print(
                    f"    {row['step']:<11} {row['step_ms'] / 1000:>7.1f} {row['bubble']:>7.1%} "
                    f"{row['gpu_days']:>9.1f} {row['gpu_days'] / base:>5.2f} {ref} "
                    f"{row['stage0_units']:>12} {row['peak_gib']:>8.1f} {row['fits']}"
                )
    print("\nomnibal plan time, internvl-6b-20b, tp=1, fixed PP (baseline search included):")
    for row in report["plan_seconds"]:
        print(
            f"  pp={row['pp']:>2}: {row['cpu_s']:.2f} s CPU ({row['wall_s']:.2f} s wall; "
            f"baseline search {row['baseline_search_cpu_s']:.2f} s CPU)  step {row['step_ms']}"
        )
    print("\nexact search vs exhaustive optimum, internvl-6b-20b (tp=1, m=4 x PP):")
    for row in report["optimality"]:
        print(
            f"  pp={row['pp']}: {row['splits']} splits, {row['fit_memory']} fit memory, "
            f"{row['simulated']} could beat the search (simulated); search "
            f"{row['search_step_ms']:.1f} ms vs optimum {row['optimum_step_ms']:.1f} ms "
            f"(gap {row['gap']:.3%})"
        )
    print("\ncertified search, internvl-6b-20b (tp=1): DPs + polish alone vs branch and bound:")
    for row in report["certificates"]:
        print(
            f"  pp={row['pp']:>2} m={row['m']:>2}: DPs+polish {row['dp_polish_step_ms']:.1f} ms "
            f"({row['dp_polish_cpu_s']:.2f} s CPU, {row['dp_polish_excess']:+.3%}); certified "
            f"{row['certified_step_ms']:.1f} ms ({row['certified_cpu_s']:.2f} s CPU), lower "
            f"bound {row['lower_bound_ms']:.1f} ms, proven gap {row['proven_gap']:.3%}"
        )
    print("\ncertified plans with 1, 2 and 4 model chunks per rank, internvl-6b-20b (tp=1):")
    for row in report["interleaved"]:
        print(
            f"  pp={row['pp']:>2} m={row['m']:>2}: "
            + "; ".join(
                f"vpp {v}: {row[f'vpp{v}']['step_ms'] / 1000:.2f} s "
                f"(x{row[f'vpp{v}']['step_ms'] / row['vpp1']['step_ms']:.3f}, peak "
                f"{row[f'vpp{v}']['peak_gib']} GiB, gap {row[f'vpp{v}']['proven_gap']:.1%}, "
                f"{row[f'vpp{v}']['cpu_s']} s CPU)"
                for v in (1, 2, 4)
            )
        )
    print("\nAll figures are modeled (FLOPs cost model + pipeline simulator), not measured.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=128)
    parser.add_argument("--hardware", default="A100-80G")
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument(
        "--worth-only",
        action="store_true",
        help="only the table of what each baseline and plan choice is worth on the presets",
    )
    args = parser.parse_args()
    stats = load_lengths(ROOT / "examples" / "data" / "internvl_subset.npz")
    print("what each choice is worth (step without it / step with all; modeled):")
    worth = choices_worth(
        WORTH_PRESETS, args.hardware, args.gpus, stats, args.global_batch, show=True
    )
    if args.worth_only:
        if args.json:
            Path(args.json).write_text(json.dumps({"worth": worth}, indent=1) + "\n")
        return 0
    report = {
        "note": "modeled (FLOPs cost model + pipeline simulator), not measured",
        "headline": headline(
            ("internvl-6b-20b", "internvl-6b-34b", "llava-1.5-7b", "internvl2-8b",
             "internvl3-8b", "internvl3.5-8b", "internvl3.5-38b", "llava-llama3.1-8b"),
            args.hardware, args.gpus, stats, args.global_batch,
        ),  # fmt: skip
        "ablation": [],
        "plan_seconds": plan_times(stats, args.gpus, args.hardware),
        "optimality": optimality_check(stats, args.gpus, args.hardware),
        "certificates": certificates(stats, args.gpus, args.hardware),
        "worth": worth,
        "interleaved": interleaved_steps(stats, args.gpus, args.hardware),
    }
    for name in ("internvl-6b-20b", "internvl-6b-34b"):
        report["ablation"].append(
            ablation(name, args.hardware, args.gpus, stats, args.global_batch)
        )
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
