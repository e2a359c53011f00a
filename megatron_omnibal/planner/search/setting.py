"""One parallel configuration: its drawn micro-batches, cost model and predicted step.

A `Setting` is what every prediction is made on: the planner's candidates, the baselines and
`omnibal simulate` build one from a `PlanRequest` and (tp, pp, dp, micro-batches), draw the same
global batch of real samples (same seed), and split it balanced (the planner's budgets) and/or
into fixed-size padded micro-batches (Megatron's way). All predictions are modeled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from megatron_omnibal.balance.budgets import auto_budget
from megatron_omnibal.planner.cost_model.costs import (
    GROUP_LLM,
    GROUP_NONE,
    GROUP_VIT,
    MIB,
    CostModel,
    LayerCosts,
    analytic_costs,
    profile_cost_model,
)
from megatron_omnibal.planner.cost_model.hardware import Hardware
from megatron_omnibal.planner.cost_model.lora_costs import lora_costs
from megatron_omnibal.planner.cost_model.memory import GIB_MIB, static_bytes_per_param
from megatron_omnibal.planner.cost_model.workload import (
    balanced_features,
    deal_to_replicas,
    draw_samples,
    padded_features,
)
from megatron_omnibal.planner.plan_file.plan import MODES
from megatron_omnibal.planner.search.interleaved import search_interleaved
from megatron_omnibal.planner.search.parallel_sizes import partition_units
from megatron_omnibal.planner.search.partition import (
    Partition,
    Problem,
    bmp,
    megatron_default,
    search,
)
from megatron_omnibal.planner.search.request import PlanRequest
from megatron_omnibal.planner.simulator.simulate import StepResult, simulate_step

PLAN_SLACK = 1.05  # a micro-batch's budgets: its mean share of the samples, plus 5%


@dataclass(frozen=True)
class Setting:
    """One parallel configuration with its drawn micro-batches and cost model."""

    tp: int
    pp: int
    dp: int
    m: int
    vit_budget: int
    token_budget: int
    balanced: np.ndarray | None  # (dp, m, 4) features per replica and micro-batch
    fixed: np.ndarray  # (dp, m, 4) the same samples, fixed-size micro-batches, padded
    model: CostModel
    hw: Hardware
    ep: int = 1  # expert parallel size (a mixture-of-experts LLM)
    first_stage_min_end: int = 0  # units stage 0 must hold (the ViT pinned there: its + 1)

    def problem(self, budget_mib: float, features: np.ndarray | None = None) -> Problem:
        """Search problem: time at the mean micro-batch, memory at the largest.

        Each unit's activations grow with one dimension (tiles or tokens), so the largest
        tiles and the largest tokens together bound every micro-batch. For balanced batches
        that is the budget, which the balancer may fill completely.
        """
        if features is None:
            if self.balanced is None:
                raise ValueError("this setting has no balanced micro-batches: pass features")
            features = self.balanced
        balanced = features is self.balanced
        flat = features.reshape(-1, 4)
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
            inbound_mib=peak.inbound_mib,
        )
        return Problem(costs, self.m, budget_mib, self.p2p_ms(mean.output_mib),
                       self.first_stage_min_end)  # fmt: skip

    def link_gbs(self) -> float:
        """Pipeline peers are tp x dp ranks apart: another node once that fills a node."""
        return (
            self.hw.network_gbs
            if self.tp * self.dp >= self.hw.gpus_per_node
            else self.hw.nvlink_gbs
        )

    def p2p_terms(self) -> tuple[float, float]:
        """(ms per transfer, ms per MiB sent): the cost model's measured transfer time (a
        calibrated profile's `p2p_ms`) when it has one, else the hardware's latency and link."""
        if self.model.p2p_ms is not None:
            return self.model.p2p_ms, 0.0
        return self.hw.p2p_latency_ms, MIB / (self.link_gbs() * 1e9) * 1e3

    def p2p_ms(self, output_mib: np.ndarray) -> np.ndarray:
        """Transfer time across the boundary before each unit (index 0 unused)."""
        out = np.asarray(output_mib, np.float64)
        before = np.concatenate([np.zeros((1, *out.shape[1:])), out], axis=0)
        latency, per_mib = self.p2p_terms()
        return latency + before * per_mib

    def sync_ms(self, stages: list[tuple[int, int]], vpp: int = 1) -> float:
        """The step's work outside the pipeline: distributed-optimizer gradient reduce-scatter +
        parameter all-gather of the slowest rank (`stages`: [first, end) unit ranges of the
        virtual stages, chunk c of rank r at c x pp + r), plus the cost model's measured
        per-step overhead (a calibrated profile's; 0 otherwise)."""
        return self._gradient_sync_ms(stages, vpp) + self.model.step_overhead_ms

    def _gradient_sync_ms(self, stages: list[tuple[int, int]], vpp: int) -> float:
        if self.dp == 1:
            return 0.0
        bw = (
            self.hw.network_gbs if self.tp * self.dp > self.hw.gpus_per_node else self.hw.nvlink_gbs
        )
        per_param = static_bytes_per_param(self.dp)
        units = len(self.model.names)
        synced, first, last = self.model.sync()
        pp = len(stages) // vpp
        rank_static = np.zeros(pp)
        for v, (lo, hi) in enumerate(stages):
            static = float(np.sum(synced[lo:hi]))
            static += first if lo == 0 else 0.0
            static += last if hi == units else 0.0
            rank_static[v % pp] += static
        params = float(rank_static.max()) * MIB / per_param
        return (self.dp - 1) / self.dp * params * 6 / (bw * 1e9) * 1e3

    def stage_times(self, part: Partition, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(stages, m) forward and backward (+ recompute) ms per (virtual) stage for one
        replica's batches."""
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
        """(stages - 1, m) transfer ms across each stage boundary for one replica's batches."""
        if self.pp == 1:
            return 0.0
        return self.p2p_ms(self.model.at(features).output_mib)[list(part.bounds[1:-1])]

    def batches(self) -> np.ndarray:
        """The balanced micro-batches when drawn, else the fixed-size ones."""
        return self.fixed if self.balanced is None else self.balanced

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
            for c in (self.model.at(self.batches()[r]) for r in range(self.dp))
        ]
        return max(work) / self.pp

    def predict(self, part: Partition, features: np.ndarray) -> StepResult:
        """Simulate every replica's own micro-batches (features (dp, m, 4)) through `part`."""
        replicas = [self.stage_times(part, features[r]) for r in range(self.dp)]
        p2ps = [self.stage_p2p(part, features[r]) for r in range(self.dp)]
        return simulate_step(
            replicas, self.pp, part.vpp, p2ps, self.sync_ms(part.stages, part.vpp)
        )


def draw_batch(request: PlanRequest) -> np.ndarray:
    """The global batch every prediction of a request is made on (same seed, same samples)."""
    rng = np.random.default_rng(request.seed)
    return draw_samples(request.lengths, request.global_batch, rng)


def make_setting(
    request: PlanRequest,
    tp: int,
    pp: int,
    dp: int,
    m: int,
    budgets: tuple[int, int] | None = None,
    balanced: bool = True,
    ep: int = 1,
) -> Setting:
    """Split the request's global batch into dp x m micro-batches: fixed-size (padded), and,
    with `balanced`, by the (vit, token) `budgets` (default: balance/budgets.py's rule for
    this size)."""
    gb, stats = request.global_batch, request.lengths
    if gb < dp * m:
        raise ValueError(
            f"global batch of {gb} samples is too small for dp={dp} x "
            f"{m} micro-batches (at least one sample per micro-batch)"
        )
    index = draw_batch(request)
    fixed = padded_features(stats, index, dp * m).reshape(dp, m, 4)
    vit_b, tok_b, split = 0, 0, None
    if balanced:
        vit_b, tok_b = budgets or auto_budget(stats, samples_per_pack=(gb // dp) / m,
                                              slack=PLAN_SLACK, tokens_follow_tiles=False)
        split = deal_to_replicas(
            balanced_features(stats, index, dp * m, vit_b, tok_b), dp, vit_b, tok_b
        )
    pinned = model_units_before_llm(request.model) if request.vit_on_first_stage else 0
    return Setting(tp, pp, dp, m, vit_b, tok_b, split, fixed, cost_model(request, tp, dp, ep),
                   request.hardware, ep, pinned)  # fmt: skip


def model_units_before_llm(model) -> int:
    """The ViT layers and the projector (with any DeepStack mergers): the vision side."""
    return model.vit.num_layers + 1


def cost_model(request: PlanRequest, tp: int, dp: int, ep: int = 1) -> CostModel:
    """The FLOPs model at (tp, dp, ep), or the request's measured profile (TP 1) re-sharded for
    dp."""
    model = request.model
    if request.profile is None:
        costs = analytic_costs(model, request.hardware, tp, dp,
                               image_tiles=request.lengths.image_flags, ep=ep)  # fmt: skip
        return costs if request.lora is None else lora_costs(costs, model, request.lora, tp, dp)
    units = partition_units(model)
    cm = profile_cost_model(request.profile, request.profile_path or "profile", dp)
    if len(cm.names) != units:
        raise ValueError(
            f"profile has {len(cm.names)} layers, {model.name} has {units} partition units "
            f"({model.vit.num_layers} ViT layers, projector, {model.llm.num_layers} LLM layers)"
        )
    return cm


def budget_mib(hw: Hardware) -> float:
    """Per-GPU memory the plan may use: device memory minus the reserve."""
    return (hw.memory_gib - hw.reserve_gib) * GIB_MIB


def choose_partition(
    setting: Setting,
    mode: str,
    features: np.ndarray | None = None,
    recompute: bool = True,
    quick: bool = False,
    vpp: int = 1,
) -> tuple[Partition, Problem]:
    """Partition by `mode`; without `recompute`, every layer is recomputed (Megatron's way).

    `quick` (screening many parallel sizes) simulates only the exact objective's best split.
    With `vpp` > 1 (exact mode only), the split is into pp x vpp virtual stages for
    interleaved 1F1B (`interleaved.search_interleaved`).
    """
    problem = setting.problem(budget_mib(setting.hw), features)
    if not recompute and mode != "megatron":
        problem = Problem(
            full_recompute_costs(problem.costs), problem.m, problem.budget, problem.p2p,
            problem.first_stage_min_end,
        )
    if vpp > 1 and mode != "exact":
        raise ValueError(f"virtual stages (vpp {vpp}) are searched in exact mode only")
    if vpp > 1:
        tolerance, evaluations = (None, 0) if quick else (1e-3, 2048)
        part = search_interleaved(problem, setting.pp, vpp, tolerance, max_evaluations=evaluations)
    elif mode == "megatron":
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
