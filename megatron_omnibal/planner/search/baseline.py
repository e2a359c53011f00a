"""The baseline a speedup is measured against: the best Megatron-LM configuration by hand.

For the same model, GPUs and global batch, a Megatron-LM user chooses TP, PP (DP follows), the
micro-batch size and recomputation, and lays the VLM out as Megatron's LLaVA does: the vision
encoder and projector on the first stage, the LLM layers split evenly or unevenly with
`--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers` (megatron-core
0.19: both >= 1, the layers left split evenly over the middle stages, each >= 1). Batches have a
fixed number of samples, each padded to the longest of its micro-batch. Recompute is what the
flags offer: `--recompute-vision` (every ViT layer, Megatron-LM's multimodal example) and
`--recompute-num-layers k` with the block method (the first k LLM layers of every stage, or of
every model chunk). The schedule is 1F1B or Megatron's interleaved 1F1B with 2 to 4 model
chunks per rank (`--num-virtual-stages-per-pipeline-rank`): micro-batches divisible by PP, every
rank's LLM layers divisible by the chunk count and split evenly over its chunks, the vision
encoder and projector on the first chunk of the first rank.

`best_megatron_baseline` finds the fastest such configuration that fits memory, exactly for the
planner's predicted step (the same simulator and cost model as the plan): a configuration's
smallest fitting k is its fastest (recompute only adds time), and every configuration is
ranked by a lower bound on its step (per replica, the busiest stage plus the first forward
reaching it and the last backward leaving it); configurations are simulated best bound first
until the bound exceeds the best step found.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, replace

import numpy as np

from megatron_omnibal.planner.cost_model.costs import GROUP_LLM, GROUP_VIT, MIB
from megatron_omnibal.planner.cost_model.memory import inflight_states, static_bytes_per_param
from megatron_omnibal.planner.search.interleaved import evaluate_interleaved
from megatron_omnibal.planner.search.parallel_sizes import (
    VPP_SIZES,
    divisors,
    ep_candidates,
    parallel_candidates,
)
from megatron_omnibal.planner.search.partition import Partition, Problem
from megatron_omnibal.planner.search.request import PlanRequest
from megatron_omnibal.planner.search.setting import (
    Setting,
    budget_mib,
    choose_partition,
    make_setting,
)
from megatron_omnibal.planner.simulator.simulate import StepResult, simulate

FIT_TOLERANCE_MIB = 1e-6  # as Problem.fits


@dataclass(frozen=True)
class BaselineConfig:
    """One configuration a Megatron-LM user can set with flags."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    micro_batches: int
    llm_layers: tuple[int, ...]  # per stage
    recompute_vision: bool
    recompute_num_layers: int  # block method, every stage (0: none)
    vpp: int = 1  # model chunks per rank (interleaved 1F1B when > 1)
    ep: int = 1  # expert parallel size (--expert-model-parallel-size; a MoE LLM)

    def chunk_layers(self) -> list[int]:
        """LLM layers per virtual stage (chunk c of rank r is virtual stage c x pp + r): each
        rank's layers split evenly over its chunks, as Megatron does."""
        return [n // self.vpp for _ in range(self.vpp) for n in self.llm_layers]

    def bounds(self, vit_layers: int) -> tuple[int, ...]:
        """(Virtual) stage boundaries over the units [ViT layers, projector, LLM layers]."""
        out = [0]
        for s, n in enumerate(self.chunk_layers()):
            out.append(out[-1] + n + (vit_layers + 1 if s == 0 else 0))
        return tuple(out)

    def recompute(self, vit_layers: int) -> list[dict[int, int]]:
        """Recompute counts per (virtual) stage and tower (the planner's Partition convention):
        the block method recomputes the first k layers of every model chunk."""
        out = []
        for s, n in enumerate(self.chunk_layers()):
            counts = {GROUP_LLM: min(self.recompute_num_layers, n)}
            if s == 0:
                counts[GROUP_VIT] = vit_layers if self.recompute_vision else 0
            out.append(counts)
        return out


@dataclass(frozen=True)
class Baseline:
    config: BaselineConfig
    setting: Setting  # its fixed-size micro-batches are `setting.fixed`
    part: Partition
    result: StepResult


@dataclass(frozen=True)
class BaselineSearch:
    """The best configuration (None: none fits memory) and how many were considered."""

    best: Baseline | None
    searched: int
    fitting: int


def llm_splits(num_layers: int, pp: int) -> list[tuple[int, ...]]:
    """LLM layers per stage that Megatron's flags can express: even, or first/last given with
    the rest split evenly over the middle stages; every stage holds at least one layer."""
    if pp == 1:
        return [(num_layers,)]
    out = []
    for first in range(1, num_layers):
        for last in range(1, num_layers - first + 1):
            rest, middle = num_layers - first - last, pp - 2
            if middle == 0 and rest == 0:
                out.append((first, last))
            elif middle and rest >= middle and rest % middle == 0:
                out.append((first, *[rest // middle] * middle, last))
    return out


def even_split(num_layers: int, pp: int) -> list[tuple[int, ...]]:
    """The split without --decoder-first/last-pipeline-num-layers (none if PP does not divide)."""
    return [(num_layers // pp,) * pp] if num_layers % pp == 0 else []


def interleaved_splits(split: tuple[int, ...], micro_batches: int) -> list[int]:
    """Model chunks per rank Megatron accepts for an LLM split: 1, or with pp >= 2 and
    micro-batches divisible by pp, every rank's layers divisible by the chunk count (its checks
    of --decoder-first/last-pipeline-num-layers and of the middle ranks under a virtual
    pipeline size)."""
    pp = len(split)
    return [
        v
        for v in VPP_SIZES
        if v == 1 or (pp >= 2 and micro_batches % pp == 0 and all(n % v == 0 for n in split))
    ]


def evaluate_config(problem: Problem, config: BaselineConfig, vit_layers: int) -> Partition:
    """The configuration's partition: times, memory (1F1B or interleaved in-flight) and step."""
    bounds, recompute = config.bounds(vit_layers), config.recompute(vit_layers)
    if config.vpp == 1:
        return problem.evaluate(bounds, recompute)
    return evaluate_interleaved(problem, bounds, recompute, config.pp, config.vpp)


def baseline_from_config(request: PlanRequest, config: BaselineConfig) -> Baseline:
    """Predict one given configuration (its fixed-size micro-batches drawn as the plan's)."""
    setting = make_setting(
        request, config.tp, config.pp, config.dp, config.micro_batches, balanced=False,
        ep=config.ep,
    )
    problem = setting.problem(budget_mib(request.hardware), setting.fixed)
    part = evaluate_config(problem, config, request.model.vit.num_layers)
    return Baseline(config, setting, part, setting.predict(part, setting.fixed))


def same_parallel_baseline(setting: Setting) -> tuple[Partition, StepResult, bool]:
    """Megatron's layout at the plan's own sizes (ViT on stage 0, LLM even, every layer
    recomputed) on fixed-size padded batches: partition, predicted step, fits memory."""
    part, problem = choose_partition(setting, "megatron", setting.fixed)
    return part, setting.predict(part, setting.fixed), problem.fits(part)


@functools.cache
def _inflight(rank: int, pp: int, vpp: int, micro_batches: int) -> np.ndarray:
    """inflight_states as an array (in-flight states x chunks), made once per schedule."""
    return np.array(inflight_states(rank, pp, vpp, micro_batches), np.float64)


class _Layouts:
    """Memory and step bounds of every layout of one (tp, pp, dp, micro-batch size).

    Everything here is prefix sums over the units, so that tens of thousands of layouts are
    screened in well under a second; the survivors are checked with the planner's own
    Problem.evaluate / Problem.fits and simulated.
    """

    def __init__(self, setting: Setting, budget: float, vit_layers: int):
        self.setting, self.budget, self.nv = setting, budget, vit_layers
        self.problem = setting.problem(budget, setting.fixed)
        cm, peak = setting.model, self.problem.costs  # peak: activations at the largest batch
        group = np.asarray(cm.group)
        vit, llm = group == GROUP_VIT, group == GROUP_LLM

        def prefix(rows: np.ndarray) -> np.ndarray:
            rows = np.asarray(rows, np.float64)
            return np.concatenate([np.zeros((1, *rows.shape[1:])), np.cumsum(rows, axis=0)])

        self.fwd, self.bwd = prefix(cm.forward), prefix(cm.backward)
        self.rec_vit = prefix(cm.recompute * vit[:, None])
        self.rec_llm = prefix(cm.recompute * llm[:, None])
        self.first, self.last, self.out = cm.first, cm.last, cm.output
        act, ckpt = np.asarray(peak.activation_mib), np.asarray(peak.checkpoint_mib)
        self.static = prefix(cm.static_mib)
        synced, first_sync, last_sync = cm.sync()
        self.synced = prefix(synced)  # what DP reduces: every parameter, or LoRA's adapters
        self.pinned_sync = (first_sync, last_sync)
        self.act = prefix(act)
        inbound = peak.inbound_mib  # received beside the hidden state at each stage's start
        self.inbound = np.zeros(len(act) + 1) if inbound is None else np.append(inbound, 0.0)
        self.inbound[0] = 0.0
        self.vit_saved = prefix(np.where(vit, act - ckpt, 0.0))
        self.llm_saved = prefix(np.where(llm, act - ckpt, 0.0))
        self.pinned = (  # static, stored activations of the first / last stage's pinned work
            (cm.first_static_mib, float(peak.first.activation_mib)),
            (cm.last_static_mib, float(peak.last.activation_mib)),
        )
        x = setting.fixed  # (dp, m, 4)
        self.x_first, self.x_last, self.x_sum = x[:, 0], x[:, -1], x.sum(axis=1)
        self.p2p_latency, self.p2p_scale = setting.p2p_terms()
        self.units = len(cm.names)
        dp = setting.dp
        self.sync_per_mib = (
            0.0
            if dp == 1
            else (dp - 1)
            / dp
            * MIB
            / static_bytes_per_param(dp)
            * 6
            / (
                (
                    setting.hw.network_gbs
                    if setting.tp * dp > setting.hw.gpus_per_node
                    else setting.hw.nvlink_gbs
                )
                * 1e9
            )
            * 1e3
        )  # fmt: skip  (Setting.sync_ms per MiB of a stage's static memory)

    def fitting_recompute(
        self, bounds: np.ndarray, vision: bool, top: int, vpp: int = 1
    ) -> np.ndarray:
        """(layouts, top + 1): whether every rank fits with --recompute-num-layers 0..top, for
        each row of `bounds` (the boundaries of the pp x vpp virtual stages of one layout; a
        rank's peak over its in-flight states)."""
        b = np.asarray(bounds)
        lo, hi = b[:, :-1], b[:, 1:]
        pp = lo.shape[1] // vpp
        static = self.static[hi] - self.static[lo]
        stored = self.act[hi] - self.act[lo] + self.inbound[lo]
        static[:, 0] += self.pinned[0][0]
        stored[:, 0] += self.pinned[0][1] - (
            self.vit_saved[np.minimum(hi[:, 0], self.nv)] if vision else 0.0
        )
        static[:, -1] += self.pinned[1][0]
        stored[:, -1] += self.pinned[1][1]
        llm_lo = np.maximum(lo, self.nv + 1)
        ks = np.minimum(np.arange(top + 1), (hi - llm_lo)[:, :, None])  # (layouts, stages, k)
        saved = self.llm_saved[llm_lo[:, :, None] + ks] - self.llm_saved[llm_lo][:, :, None]
        held = stored[:, :, None] - saved  # per micro-batch
        fits = np.ones((len(b), top + 1), bool)
        for r in range(pp):
            peak = static[:, r::pp].sum(axis=1)[:, None] + (
                _inflight(r, pp, vpp, self.setting.m) @ held[:, r::pp]
            ).max(axis=1)
            fits &= peak <= self.budget + FIT_TOLERANCE_MIB
        return fits

    def lower_bound(
        self, bounds: np.ndarray, vision: bool, k: np.ndarray, vpp: int = 1
    ) -> tuple[np.ndarray, np.ndarray]:
        """For each row of `bounds` (one layout's virtual stage boundaries) with its
        --recompute-num-layers `k`: a lower bound on the step, and (dp,) lower bounds on each
        replica's pipeline: per rank, the first forward reaching its first (virtual) stage, all
        its work, the last backward leaving that stage (a rank's first and last operations are
        on chunk 0)."""
        b = np.asarray(bounds)
        lo, hi = b[:, :-1], b[:, 1:]
        cf = self.fwd[hi] - self.fwd[lo]  # (layouts, stages, features)
        llm_lo = np.maximum(lo, self.nv + 1)
        cb = self.bwd[hi] - self.bwd[lo]
        cb += self.rec_llm[np.minimum(llm_lo + np.asarray(k)[:, None], hi)] - self.rec_llm[llm_lo]
        cf[:, 0] += self.first[0]
        cb[:, 0] += self.first[1] + (
            self.rec_vit[np.minimum(hi[:, 0], self.nv)] if vision else 0.0
        )
        cf[:, -1] += self.last[0]
        cb[:, -1] += self.last[1]
        busy = self.x_sum @ np.swapaxes(cf + cb, 1, 2)  # (layouts, dp, stages)
        head = self.x_first @ np.swapaxes(cf, 1, 2)
        tail = self.x_last @ np.swapaxes(cb, 1, 2)
        if b.shape[1] > 2:
            out = np.swapaxes(self.out[b[:, 1:-1] - 1], 1, 2)  # (layouts, features, stages - 1)
            lat = self.p2p_latency
            head[:, :, :-1] += lat + self.x_first @ out * self.p2p_scale
            tail[:, :, :-1] += lat + self.x_last @ out * self.p2p_scale
        layouts, dp, stages = busy.shape
        pp = stages // vpp
        before = np.cumsum(head, axis=2) - head + np.cumsum(tail, axis=2) - tail
        busy = busy.reshape(layouts, dp, vpp, pp).sum(axis=2)
        replicas = np.max(before[:, :, :pp] + busy, axis=2)
        static = self.synced[hi] - self.synced[lo]
        static[:, 0] += self.pinned_sync[0]
        static[:, -1] += self.pinned_sync[1]
        static = static.reshape(layouts, vpp, pp).sum(axis=1)
        return replicas.max(axis=1) + static.max(axis=1) * self.sync_per_mib, replicas

    def step_below(self, part: Partition, replica_lb: np.ndarray, cutoff: float) -> float:
        """The predicted step (as Setting.predict), or inf as soon as one replica shows it
        cannot beat `cutoff` (replicas with the largest lower bound are simulated first)."""
        st, feats = self.setting, self.setting.fixed
        sync = st.sync_ms(part.stages, part.vpp)
        worst = 0.0
        for r in np.argsort(-replica_lb):
            fwd, bwd = st.stage_times(part, feats[r])
            p2p = st.stage_p2p(part, feats[r])
            span = simulate(fwd, bwd, st.pp, part.vpp, p2p, keep_ops=False)
            worst = max(worst, span.makespan_ms)
            if worst + sync >= cutoff:
                return np.inf
        return worst + sync


def best_megatron_baseline(
    request: PlanRequest,
    interleave: bool = True,
    uneven: bool = True,
    recompute: bool = True,
    micro_batch_sizes: bool = True,
) -> BaselineSearch:
    """The fastest hand-set Megatron-LM configuration that fits memory (module docstring).

    Each flag off takes one of the user's choices away (to price it): `interleave` 1F1B only,
    `uneven` the even LLM split only, `recompute` no recompute flags, `micro_batch_sizes`
    micro-batch size 1 only."""
    model, hw = request.model, request.hardware
    nv, nl, gb = model.vit.num_layers, model.llm.num_layers, request.global_batch
    budget = budget_mib(hw)
    tp = 1 if request.profile is not None else None
    # (bound, the configuration's place in the listing: of equal bounds the first is tried first)
    queue: list[tuple[float, tuple, tuple[BaselineConfig, int], _Layouts, np.ndarray]] = []
    searched = fitting = listed = 0
    visions = (False, True) if recompute else (False,)
    sizes = [
        (t, p, d, e, mbs)
        for t, p, d in parallel_candidates(model, hw, request.gpus, tp, None, max_pp=nl)
        if gb % d == 0  # Megatron needs global batch = micro-batch size x micro-batches x dp
        for e in ep_candidates(model, d, request.search_ep)
        for mbs in (divisors(gb // d) if micro_batch_sizes else [1])
    ]
    for t, p, d, e, mbs in sizes:
        m = gb // d // mbs
        listed += 1
        layouts = _Layouts(make_setting(request, t, p, d, m, balanced=False, ep=e), budget,
                           nv)  # fmt: skip
        splits = llm_splits(nl, p) if uneven else even_split(nl, p)
        chunks = [interleaved_splits(s, m) if interleave else [1] for s in splits]
        for v in VPP_SIZES:  # the layouts of one chunk count, screened at once
            which = [i for i, vs in enumerate(chunks) if v in vs]
            if not which:
                continue
            configs = [BaselineConfig(t, p, d, mbs, m, splits[i], False, 0, v, e)
                       for i in which]  # fmt: skip
            bounds = np.array([c.bounds(nv) for c in configs])
            tops = np.array([max(c.chunk_layers()) for c in configs])
            for vision in visions:
                searched += int(tops.sum()) + len(tops)
                fits = layouts.fitting_recompute(
                    bounds, vision, int(tops.max()) if recompute else 0, v
                )
                fits &= np.arange(fits.shape[1]) <= tops[:, None]
                fitting += int(fits.sum())
                any_fit = np.flatnonzero(fits.any(axis=1))
                if not len(any_fit):
                    continue
                # recompute only adds time: the least fitting k is fastest
                ks = fits[any_fit].argmax(axis=1)
                lows, replicas = layouts.lower_bound(bounds[any_fit], vision, ks, v)
                for j, k, low, reps in zip(any_fit, ks, lows, replicas, strict=True):
                    order = (listed, which[j], v, vision)
                    queue.append((float(low), order, (configs[j], int(k)), layouts, reps))
    heapq.heapify(queue)
    best: tuple[float, BaselineConfig, _Layouts, Partition] | None = None
    while queue and (best is None or queue[0][0] < best[0]):
        _, (*_, vision), (config, k), layouts, lb = heapq.heappop(queue)
        config = replace(config, recompute_vision=vision, recompute_num_layers=k)
        part = evaluate_config(layouts.problem, config, nv)
        if not layouts.problem.fits(part):
            continue  # rounding at the budget's edge: the partition's own check decides
        step = layouts.step_below(part, lb, np.inf if best is None else best[0])
        if best is None or step < best[0]:
            best = (step, config, layouts, part)
    if best is None:
        return BaselineSearch(None, searched, fitting)
    _, config, layouts, part = best
    result = layouts.setting.predict(part, layouts.setting.fixed)
    return BaselineSearch(Baseline(config, layouts.setting, part, result), searched, fitting)
