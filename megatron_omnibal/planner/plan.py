"""The joint plan: data budgets, parallel sizes, partition and per-stage recompute -> plan.json.

`make_plan` draws micro-batches from real length statistics, searches the partition (and, when
not given, TP/PP) with the FLOPs cost model, and predicts the step of the plan and of Megatron's
default (ViT on stage 0, even LLM split, full recompute, fixed-size batches) with the pipeline
simulator. All predictions are modelled, not measured. `load_plan` validates a plan.json for the
Megatron side.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from megatron_omnibal.data.lengths import LengthStats
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.config_files import read_json
from megatron_omnibal.planner.costs import (
    GROUP_LLM,
    GROUP_NONE,
    GROUP_VIT,
    MIB,
    CostModel,
    LayerCosts,
    analytic_costs,
    profile_cost_model,
)
from megatron_omnibal.planner.hardware import Hardware
from megatron_omnibal.planner.memory import GIB_MIB
from megatron_omnibal.planner.partition import (
    NoFeasiblePartition,
    Partition,
    Problem,
    bmp,
    megatron_default,
    search,
)
from megatron_omnibal.planner.simulate import StepResult, simulate_step
from megatron_omnibal.planner.workload import (
    balanced_features,
    choose_budgets,
    deal_to_replicas,
    draw_samples,
    fixed_size_features,
)

PLAN_VERSION = 1
MODES = ("exact", "bmp", "megatron")
FINALIST_MARGIN = 0.05  # a full search never gained more than ~2% over the quick screen


@dataclass(frozen=True)
class Setting:
    """One parallel configuration with its drawn micro-batches and cost model."""

    tp: int
    pp: int
    dp: int
    m: int
    vit_budget: int
    token_budget: int
    balanced: np.ndarray  # (dp, m, 4) features per replica and micro-batch
    fixed: np.ndarray  # (dp, m, 4) the same samples in fixed-size micro-batches
    model: CostModel
    hw: Hardware

    def problem(self, budget_mib: float, features: np.ndarray | None = None) -> Problem:
        """Search problem: time at the mean micro-batch, memory at the largest.

        Each unit's activations grow with one dimension (tiles or tokens), so the largest
        tiles and the largest tokens together bound every micro-batch. For balanced batches
        that is the budget, which the balancer may fill completely.
        """
        balanced = features is None or features is self.balanced
        flat = (self.balanced if features is None else features).reshape(-1, 4)
        mean = self.model.at(flat.mean(axis=0))
        most = flat.max(axis=0)
        if balanced:
            most[:2] = np.maximum(most[:2], [self.vit_budget, self.token_budget])
        peak = self.model.at(most)
        costs = replace(
            mean,
            activation_mib=peak.activation_mib,
            checkpoint_mib=peak.checkpoint_mib,
            first=replace(mean.first, activation_mib=peak.first.activation_mib),
            last=replace(mean.last, activation_mib=peak.last.activation_mib),
        )
        return Problem(costs, self.m, budget_mib, self.p2p_ms(mean.output_mib))

    def link_gbs(self) -> float:
        """Pipeline peers are tp x dp ranks apart: another node once that fills a node."""
        return (
            self.hw.network_gbs
            if self.tp * self.dp >= self.hw.gpus_per_node
            else self.hw.nvlink_gbs
        )

    def p2p_ms(self, output_mib: np.ndarray) -> np.ndarray:
        """Transfer time across the boundary before each unit (index 0 unused)."""
        out = np.asarray(output_mib, np.float64)
        before = np.concatenate([np.zeros((1, *out.shape[1:])), out], axis=0)
        return self.hw.p2p_latency_ms + before * MIB / (self.link_gbs() * 1e9) * 1e3

    def sync_ms(self, part: Partition, costs: LayerCosts) -> float:
        """Distributed-optimizer gradient reduce-scatter + parameter all-gather, slowest stage."""
        if self.dp == 1:
            return 0.0
        bw = (
            self.hw.network_gbs if self.tp * self.dp > self.hw.gpus_per_node else self.hw.nvlink_gbs
        )
        per_param = 2 + 4 + 12 / self.dp  # static bytes per parameter (as in analytic_costs)
        worst = 0.0
        for lo, hi in part.stages:
            static = float(np.sum(costs.static_mib[lo:hi]))
            static += costs.first.static_mib if lo == 0 else 0.0
            static += costs.last.static_mib if hi == len(costs) else 0.0
            params = static * MIB / per_param
            worst = max(worst, (self.dp - 1) / self.dp * params * 6 / (bw * 1e9) * 1e3)
        return worst

    def stage_times(self, part: Partition, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pp, m) forward and backward (+ recompute) ms per stage for one replica's batches."""
        costs = self.model.at(features)  # arrays (U, m)
        fwd, bwd = [], []
        for s, (lo, hi) in enumerate(part.stages):
            mask = np.zeros(hi - lo, bool)
            group = np.asarray(costs.group[lo:hi])
            for g, k in part.recompute[s].items():
                mask[np.flatnonzero(group == g)[:k]] = True
            f = costs.forward_ms[lo:hi].sum(axis=0)
            b = costs.backward_ms[lo:hi].sum(axis=0) + costs.recompute_ms[lo:hi][mask].sum(0)
            if lo == 0:
                f, b = f + costs.first.forward_ms, b + costs.first.backward_ms
            if hi == len(costs):
                f, b = f + costs.last.forward_ms, b + costs.last.backward_ms
            fwd.append(f)
            bwd.append(b)
        return np.array(fwd), np.array(bwd)

    def stage_p2p(self, part: Partition, features: np.ndarray) -> np.ndarray | float:
        """(pp - 1, m) transfer ms across each stage boundary for one replica's batches."""
        if self.pp == 1:
            return 0.0
        return self.p2p_ms(self.model.at(features).output_mib)[list(part.bounds[1:-1])]

    def ideal_ms(self) -> float:
        """A lower bound on the step: the busiest replica's work spread evenly, no bubble."""
        work = [
            float(
                np.sum(c.forward_ms)
                + np.sum(c.backward_ms)
                + np.sum(c.first.forward_ms)
                + np.sum(c.first.backward_ms)
                + np.sum(c.last.forward_ms)
                + np.sum(c.last.backward_ms)
            )
            for c in (self.model.at(self.balanced[r]) for r in range(self.dp))
        ]
        return max(work) / self.pp

    def predict(self, part: Partition, features: np.ndarray) -> StepResult:
        """Simulate every replica's own micro-batches (features (dp, m, 4)) through `part`."""
        replicas = [self.stage_times(part, features[r]) for r in range(self.dp)]
        p2ps = [self.stage_p2p(part, features[r]) for r in range(self.dp)]
        return simulate_step(
            replicas, self.pp, 1, p2ps, self.sync_ms(part, self.model.at(features[0]))
        )


def heads_divisible(model: ModelSpec, tp: int) -> bool:
    """Megatron splits attention heads (and KV groups) over TP ranks: they must divide."""
    return (
        model.vit.num_attention_heads % tp == 0
        and model.llm.num_attention_heads % tp == 0
        and model.llm.num_query_groups % tp == 0
    )


def make_setting(
    model: ModelSpec,
    hw: Hardware,
    stats: LengthStats,
    tp: int,
    pp: int,
    dp: int,
    m: int,
    global_batch: int,
    seed: int = 0,
    budgets: tuple[int, int] | None = None,
    profile: dict | None = None,
) -> Setting:
    """Draw one global batch of real samples; split it balanced and fixed-size into dp x m.

    `budgets` (vit, token) default to `choose_budgets` for this batch size. With `profile`
    (a measured layer profile, TP = 1), costs come from it instead of the FLOPs model.
    """
    if global_batch < dp * m:
        raise ValueError(
            f"global batch of {global_batch} samples is too small for dp={dp} x "
            f"{m} micro-batches (at least one sample per micro-batch)"
        )
    rng = np.random.default_rng(seed)
    index = draw_samples(stats, global_batch, rng)
    vit_b, tok_b = budgets or choose_budgets(stats, global_batch // dp, m)
    balanced = balanced_features(stats, index, dp * m, vit_b, tok_b)
    fixed = fixed_size_features(stats, index, dp * m)
    return Setting(
        tp,
        pp,
        dp,
        m,
        vit_b,
        tok_b,
        deal_to_replicas(balanced, dp, vit_b, tok_b),
        fixed.reshape(dp, m, 4),
        analytic_costs(model, hw, tp, dp)
        if profile is None
        else _profile_costs(model, profile, dp),
        hw,
    )


def _profile_costs(model: ModelSpec, profile: dict, dp: int) -> CostModel:
    units = model.vit.num_layers + 1 + model.llm.num_layers
    cm = profile_cost_model(profile, "profile", dp)
    if len(cm.names) != units:
        raise ValueError(
            f"profile has {len(cm.names)} layers, {model.name} has {units} partition units "
            f"({model.vit.num_layers} ViT layers, projector, {model.llm.num_layers} LLM layers)"
        )
    return cm


def budget_mib(hw: Hardware) -> float:
    return (hw.memory_gib - hw.reserve_gib) * GIB_MIB


def choose_partition(
    setting: Setting,
    mode: str,
    features: np.ndarray | None = None,
    recompute: bool = True,
    quick: bool = False,
) -> tuple[Partition, Problem]:
    """Partition by `mode`; without `recompute`, every layer is recomputed (Megatron's way).

    `quick` (screening many parallel sizes) simulates only the exact objective's best split.
    """
    problem = setting.problem(budget_mib(setting.hw), features)
    if not recompute and mode != "megatron":
        problem = Problem(
            full_recompute_costs(problem.costs), problem.m, problem.budget, problem.p2p
        )
    if mode == "megatron":
        part = megatron_default(problem, setting.pp, full_recompute=True)
    elif mode == "bmp":
        part = bmp(problem, setting.pp)
    elif mode == "exact":
        part = (
            search(problem, setting.pp, refine=1, max_evaluations=0, tolerance=None)
            if quick
            else search(problem, setting.pp)
        )
    else:
        raise ValueError(f"unknown partition mode '{mode}' (choose from {', '.join(MODES)})")
    if not recompute and mode != "megatron":
        part = replace(
            part,
            recompute=tuple(
                {
                    g: int(np.sum(setting.model.group[lo:hi] == g))
                    for g in (GROUP_VIT, GROUP_LLM)
                    if np.any(setting.model.group[lo:hi] == g)
                }
                for lo, hi in part.stages
            ),
        )
    return part, problem


def full_recompute_costs(costs: LayerCosts) -> LayerCosts:
    """Costs with every recomputable layer recomputed, folded in: no recompute choice left."""
    on = np.asarray(costs.group) >= 0
    return replace(
        costs,
        backward_ms=costs.backward_ms + np.where(on, costs.recompute_ms, 0.0),
        activation_mib=np.where(on, costs.checkpoint_mib, costs.activation_mib),
        recompute_ms=np.zeros_like(costs.recompute_ms),
        group=np.full(len(costs), GROUP_NONE),
    )


def micro_batch_candidates(pp: int, samples_per_replica: int) -> list[int]:
    """Micro-batch counts worth trying: 2 and 4 per stage (fewer if samples run out)."""
    cands = sorted({min(k * pp, samples_per_replica) for k in (2, 4)})
    return [m for m in cands if m >= 1]


def parallel_candidates(
    model: ModelSpec, hw: Hardware, gpus: int, tp: int | None, pp: int | None
) -> list[tuple[int, int, int]]:
    """(tp, pp, dp) with tp within a node dividing the heads, pp up to the unit count."""
    units = model.vit.num_layers + 1 + model.llm.num_layers
    tps = (
        [tp]
        if tp
        else [t for t in (1, 2, 4, 8) if t <= hw.gpus_per_node and heads_divisible(model, t)]
    )
    out = []
    for t in tps:
        pps = [pp] if pp else [p for p in range(1, units + 1) if gpus % (t * p) == 0]
        for p in pps:
            if gpus % (t * p) == 0:
                out.append((t, p, gpus // (t * p)))
    return out


def check_parallel(model: ModelSpec, gpus: int, tp: int | None, pp: int | None) -> None:
    """Clear errors for impossible parallel sizes before any search."""
    units = model.vit.num_layers + 1 + model.llm.num_layers
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if tp is not None and (tp < 1 or not heads_divisible(model, tp)):
        raise ValueError(
            f"--tp {tp}: must divide the attention heads (ViT "
            f"{model.vit.num_attention_heads}, LLM {model.llm.num_attention_heads}, "
            f"KV groups {model.llm.num_query_groups})"
        )
    if pp is not None and not 1 <= pp <= units:
        raise ValueError(
            f"--pp {pp}: must be between 1 and the {units} partition units of "
            f"{model.name} ({model.vit.num_layers} ViT layers, projector, "
            f"{model.llm.num_layers} LLM layers)"
        )
    if (tp or 1) * (pp or 1) > gpus or gpus % ((tp or 1) * (pp or 1)):
        raise ValueError(f"--gpus {gpus} is not a multiple of tp x pp = {(tp or 1) * (pp or 1)}")


@dataclass(frozen=True)
class Evaluated:
    setting: Setting
    part: Partition
    result: StepResult


def plan_candidates(
    model: ModelSpec,
    hw: Hardware,
    stats: LengthStats,
    gpus: int,
    tp: int | None = None,
    pp: int | None = None,
    micro_batches: int | None = None,
    global_batch: int = 1024,
    mode: str = "exact",
    seed: int = 0,
    progress: bool = False,
    finalists: int = 3,
    profile: dict | None = None,
) -> list[Evaluated]:
    """Feasible (tp, pp, dp, m) with their partition and predicted step, fastest first.

    With more than one configuration, each is screened with a quick search and the best
    `finalists` are searched in full (skipping those screened over FINALIST_MARGIN slower
    than the best fully searched one); configurations that cannot beat the best so far
    even without any bubble are skipped. A measured `profile` fixes TP at 1 (it was measured
    on one GPU).
    """
    if profile is not None:
        if tp not in (None, 1):
            raise ValueError(f"--tp {tp}: a measured profile is for TP = 1 (one GPU per layer)")
        tp = 1
    check_parallel(model, gpus, tp, pp)
    configs = [
        (t, p, d, m)
        for t, p, d in parallel_candidates(model, hw, gpus, tp, pp)
        if global_batch // d >= 1
        for m in (
            [micro_batches] if micro_batches else micro_batch_candidates(p, global_batch // d)
        )
    ]
    if progress and len(configs) > 4:
        from tqdm import tqdm

        configs = tqdm(configs, desc="plan: parallel sizes", unit="config")
    out, errors = [], []
    best = np.inf
    for t, p, d, m in configs:
        try:
            setting = make_setting(
                model, hw, stats, t, p, d, m, global_batch, seed, profile=profile
            )
            if setting.ideal_ms() >= best:  # even a bubble-free perfect split would lose
                continue
            part, _ = choose_partition(setting, mode, quick=len(configs) > 1)
        except NoFeasiblePartition as exc:
            errors.append(f"tp={t} pp={p} dp={d} m={m}: {exc}")
            continue
        except ValueError as exc:
            if tp is not None and pp is not None:
                raise
            errors.append(f"tp={t} pp={p} dp={d} m={m}: {exc}")
            continue
        out.append(Evaluated(setting, part, setting.predict(part, setting.balanced)))
        best = min(best, out[-1].result.step_ms)
    if len(configs) > 1 and out:  # screened quickly: search the finalists in full
        out.sort(key=lambda e: e.result.step_ms)
        best = np.inf
        for i, e in enumerate(out[:finalists]):
            if e.result.step_ms > best * (1 + FINALIST_MARGIN):
                break  # the full search gains a few % at most: this one cannot catch up
            part, _ = choose_partition(e.setting, mode)
            out[i] = Evaluated(e.setting, part, e.setting.predict(part, e.setting.balanced))
            best = min(best, out[i].result.step_ms)
    if not out:
        detail = errors[0] if len(errors) == 1 else "\n  ".join(["", *errors[:8]])
        raise NoFeasiblePartition(
            f"no feasible plan for {model.name} on {gpus} x {hw.name}: {detail}"
        )
    return sorted(out, key=lambda e: e.result.step_ms)


def baseline(setting: Setting) -> tuple[Partition, StepResult, bool]:
    """Megatron's default on fixed-size batches: partition, predicted step, fits memory."""
    part, problem = choose_partition(setting, "megatron", setting.fixed)
    return part, setting.predict(part, setting.fixed), problem.fits(part)


def stage_entries(model: ModelSpec, part: Partition) -> list[dict]:
    """plan.json `stages`: unit ranges mapped back to per-tower layer ranges."""
    nv, nl = model.vit.num_layers, model.llm.num_layers
    out = []
    for s, (lo, hi) in enumerate(part.stages):
        rec = part.recompute[s]
        out.append(
            {
                "stage": s,
                "vit_layers": [min(lo, nv), min(hi, nv)],
                "llm_layers": [min(max(lo - nv - 1, 0), nl), min(max(hi - nv - 1, 0), nl)],
                "patch_embed": lo == 0,
                "projector": lo <= nv < hi,
                "llm_embed": lo <= nv < hi,
                "head": hi == nv + 1 + nl,
                "vit_recompute": int(rec.get(GROUP_VIT, 0)),
                "llm_recompute": int(rec.get(GROUP_LLM, 0)),
                "forward_ms": round(float(part.forward_ms[s]), 4),
                "backward_ms": round(float(part.backward_ms[s]), 4),
                "peak_memory_gib": round(float(part.memory_mib[s]) / GIB_MIB, 3),
            }
        )
    return out


def megatron_flags(model: ModelSpec, setting: Setting, plan_path: str) -> list[str]:
    """Megatron arguments for the plan; the per-stage layout and recompute come from the plan."""
    llm = model.llm
    flags = [
        "--tensor-model-parallel-size",
        str(setting.tp),
        "--pipeline-model-parallel-size",
        str(setting.pp),
        "--num-layers",
        str(llm.num_layers),
        "--hidden-size",
        str(llm.hidden_size),
        "--ffn-hidden-size",
        str(llm.ffn_hidden_size),
        "--num-attention-heads",
        str(llm.num_attention_heads),
    ]
    if llm.num_query_groups < llm.num_attention_heads:
        flags += ["--group-query-attention", "--num-query-groups", str(llm.num_query_groups)]
    flags += ["--normalization", "RMSNorm" if llm.norm == "rmsnorm" else "LayerNorm"]
    if llm.gated_mlp:
        flags += ["--swiglu"]
    flags += [
        "--seq-length",
        str(setting.token_budget),
        "--max-position-embeddings",
        str(setting.token_budget),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        str(setting.m * setting.dp),
        "--bf16",
        "--use-distributed-optimizer",
        "--calculate-per-token-loss",
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--omnibal-plan",
        plan_path,
    ]
    if setting.tp > 1:
        flags.append("--sequence-parallel")
    return flags


def make_plan(
    model: ModelSpec,
    hw: Hardware,
    stats: LengthStats,
    gpus: int,
    tp: int | None = None,
    pp: int | None = None,
    micro_batches: int | None = None,
    global_batch: int = 1024,
    mode: str = "exact",
    seed: int = 0,
    plan_path: str = "plan.json",
    progress: bool = False,
    profile: dict | None = None,
) -> dict:
    """The plan.json document for the fastest feasible configuration."""
    best = plan_candidates(
        model,
        hw,
        stats,
        gpus,
        tp,
        pp,
        micro_batches,
        global_batch,
        mode,
        seed,
        progress,
        profile=profile,
    )[0]
    st = best.setting
    base_part, base, base_fits = baseline(st)
    return {
        "version": PLAN_VERSION,
        "model": model.name,
        "hardware": hw.name,
        "parallel": {
            "tp": st.tp,
            "pp": st.pp,
            "dp": st.dp,
            "vpp": 1,
            "micro_batches": st.m,
            "gpus": gpus,
        },
        "model_spec": model.to_dict(),
        "hardware_spec": hw.to_dict(),
        "stages": stage_entries(model, best.part),
        "data": {
            "vit_budget": st.vit_budget,
            "token_budget": st.token_budget,
            "micro_batches": st.m,
            "global_batch_samples": global_batch,
            "seed": seed,
            "num_samples": len(stats),
        },
        "predicted": {
            "step_ms": round(best.result.step_ms, 3),
            "baseline_step_ms": round(base.step_ms, 3),
            "bubble_fraction": round(best.result.bubble_fraction, 4),
            "baseline_bubble_fraction": round(base.bubble_fraction, 4),
            "baseline_fits_memory": base_fits,
            "baseline_stages": [list(s) for s in base_part.stages],
            "speedup": round(base.step_ms / best.result.step_ms, 3),
            "sync_ms": round(best.result.sync_ms, 3),
            "partition_mode": mode,
            "cost_model": "analytic" if profile is None else "measured profile",
            "modeled": True,
        },
        "megatron_flags": megatron_flags(model, st, plan_path),
    }


_STAGE_KEYS = {
    "stage": int,
    "vit_layers": list,
    "llm_layers": list,
    "patch_embed": bool,
    "projector": bool,
    "llm_embed": bool,
    "head": bool,
    "vit_recompute": int,
    "llm_recompute": int,
    "forward_ms": (int, float),
    "backward_ms": (int, float),
    "peak_memory_gib": (int, float),
}


def load_plan(path: str | Path) -> dict:
    """Read and validate plan.json; errors name the file and the field."""
    plan = read_json(path, "plan")
    validate_plan(plan, str(path))
    return plan


def validate_plan(plan: dict, where: str = "plan") -> None:
    """Check the schema and that the stages tile both towers exactly once, in order."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"{where}: {msg}")

    need(isinstance(plan, dict), "expected a JSON object")
    for key in (
        "version",
        "model",
        "hardware",
        "parallel",
        "model_spec",
        "stages",
        "data",
        "predicted",
        "megatron_flags",
    ):
        need(key in plan, f"missing '{key}'")
    need(plan["version"] == PLAN_VERSION, f"version {plan['version']!r} (expected 1)")
    par = plan["parallel"]
    for key in ("tp", "pp", "dp", "vpp", "micro_batches", "gpus"):
        need(
            isinstance(par.get(key), int) and not isinstance(par.get(key), bool) and par[key] >= 1,
            f"parallel.{key} must be a positive integer",
        )
    need(
        par["tp"] * par["pp"] * par["dp"] == par["gpus"],
        f"parallel: tp x pp x dp = {par['tp'] * par['pp'] * par['dp']} != gpus {par['gpus']}",
    )
    spec = plan["model_spec"]
    for block in ("vit", "projector", "llm"):
        need(isinstance(spec.get(block), dict), f"model_spec.{block} missing")
    nv, nl = spec["vit"].get("num_layers"), spec["llm"].get("num_layers")
    need(isinstance(nv, int) and isinstance(nl, int), "model_spec num_layers must be integers")
    stages = plan["stages"]
    need(
        isinstance(stages, list) and len(stages) == par["pp"],
        f"{len(stages) if isinstance(stages, list) else 'no'} stages for pp={par['pp']}",
    )
    vit_at, llm_at = 0, 0
    for s, st in enumerate(stages):
        at = f"stages[{s}]"
        for key, kind in _STAGE_KEYS.items():
            need(key in st and isinstance(st[key], kind), f"{at}.{key} missing or mistyped")
        need(st["stage"] == s, f"{at}.stage is {st['stage']}")
        for key, start, total in (("vit_layers", vit_at, nv), ("llm_layers", llm_at, nl)):
            first, end = st[key]
            need(
                first == start and start <= end <= total,
                f"{at}.{key} {st[key]} does not continue at layer {start} within [0, {total}]",
            )
        need(
            st["vit_recompute"] <= st["vit_layers"][1] - st["vit_layers"][0]
            and st["llm_recompute"] <= st["llm_layers"][1] - st["llm_layers"][0]
            and min(st["vit_recompute"], st["llm_recompute"]) >= 0,
            f"{at}: recompute counts exceed the stage's layers",
        )
        need(st["patch_embed"] == (s == 0), f"{at}.patch_embed must be true on stage 0 only")
        need(st["head"] == (s == len(stages) - 1), f"{at}.head must be true on the last only")
        need(st["projector"] == st["llm_embed"], f"{at}: llm_embed must sit with the projector")
        if st["projector"]:
            need(
                st["vit_layers"][1] == nv and st["llm_layers"][0] == 0,
                f"{at}: the projector must follow the last ViT layer and precede LLM layer 0",
            )
        elif st["llm_layers"][1] > st["llm_layers"][0]:
            need(
                llm_at > 0 or any(x["projector"] for x in stages[:s]),
                f"{at}: LLM layers before the projector",
            )
        vit_at, llm_at = st["vit_layers"][1], st["llm_layers"][1]
    need(
        vit_at == nv and llm_at == nl,
        f"stages cover {vit_at}/{nv} ViT and {llm_at}/{nl} LLM layers",
    )
    need(sum(bool(st["projector"]) for st in stages) == 1, "exactly one stage holds the projector")
    need(isinstance(plan["megatron_flags"], list), "megatron_flags must be a list")
    samples = plan["data"].get("num_samples") if isinstance(plan["data"], dict) else None
    need(
        samples is None or (isinstance(samples, int) and samples > 0),
        f"data.num_samples must be a positive integer (the length file's samples), got {samples!r}",
    )


def partition_from_plan(
    plan: dict, model: ModelSpec
) -> tuple[tuple[int, ...], list[dict[int, int]]]:
    """Unit boundaries and recompute counts of a (validated) plan's stages."""
    bounds, recompute = [0], []
    for st in plan["stages"]:
        units = (
            st["vit_layers"][1]
            - st["vit_layers"][0]
            + int(st["projector"])
            + st["llm_layers"][1]
            - st["llm_layers"][0]
        )
        if units == 0:
            raise ValueError(f"plan: stage {st['stage']} holds no layers")
        bounds.append(bounds[-1] + units)
        rec = {}
        if st["vit_layers"][1] > st["vit_layers"][0]:
            rec[GROUP_VIT] = st["vit_recompute"]
        if st["llm_layers"][1] > st["llm_layers"][0]:
            rec[GROUP_LLM] = st["llm_recompute"]
        recompute.append(rec)
    return tuple(bounds), recompute
