"""`make_plan`: the fastest configuration for a request, its prediction and its baselines.

The headline speedup is against the best configuration a Megatron-LM user could choose by hand
for the same model, GPUs and global batch (`baseline.best_megatron_baseline`), never against
one that does not fit memory; when none fits, the plan has no speedup and says so. Megatron's
layout at the plan's own parallel sizes (the OmniBal paper's ablation baseline) is kept as a
detail. Every figure is modeled (cost model + pipeline simulator), not measured.
"""

from __future__ import annotations

from megatron_omnibal.balance.config import Level
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.cost_model.costs import GROUP_LLM, GROUP_VIT
from megatron_omnibal.planner.cost_model.memory import GIB_MIB
from megatron_omnibal.planner.packing.level_plan import pipeline, plan_levels
from megatron_omnibal.planner.packing.pack_cost import pack_cost
from megatron_omnibal.planner.plan_file.flags import baseline_flags, plan_flags
from megatron_omnibal.planner.plan_file.plan import (
    BaselinePlan,
    DataPlan,
    ParallelSizes,
    Plan,
    Prediction,
    SameParallelBaseline,
    StagePlan,
)
from megatron_omnibal.planner.plan_file.provenance import lengths_sha256, profile_sha256
from megatron_omnibal.planner.search.baseline import (
    BaselineConfig,
    BaselineSearch,
    best_megatron_baseline,
    evaluate_config,
    same_parallel_baseline,
)
from megatron_omnibal.planner.search.parallel_search import Evaluated, plan_candidates
from megatron_omnibal.planner.search.partition import Partition
from megatron_omnibal.planner.search.request import PlanRequest
from megatron_omnibal.planner.search.setting import budget_mib, make_setting


def _ms(value: float) -> float:
    return round(float(value), 4)


def stage_plans(model: ModelSpec, part: Partition) -> tuple[StagePlan, ...]:
    """A partition's unit ranges (one per virtual stage) mapped back to per-tower layer
    ranges."""
    nv, nl = model.vit.num_layers, model.llm.num_layers
    out = []
    for s, (lo, hi) in enumerate(part.stages):
        rec = part.recompute[s]
        out.append(
            StagePlan(
                stage=s,
                vit_layers=(min(lo, nv), min(hi, nv)),
                llm_layers=(min(max(lo - nv - 1, 0), nl), min(max(hi - nv - 1, 0), nl)),
                patch_embed=lo == 0,
                projector=lo <= nv < hi,
                llm_embed=lo <= nv < hi,
                head=hi == nv + 1 + nl,
                vit_recompute=int(rec.get(GROUP_VIT, 0)),
                llm_recompute=int(rec.get(GROUP_LLM, 0)),
                forward_ms=_ms(part.forward_ms[s]),
                backward_ms=_ms(part.backward_ms[s]),
                peak_memory_gib=round(float(part.memory_mib[s]) / GIB_MIB, 3),
            )
        )
    return tuple(out)


def plan_partition(plan: Plan) -> tuple[tuple[int, ...], list[dict[int, int]]]:
    """The unit boundaries and recompute counts of a plan's (virtual) stages (inverse of
    stage_plans)."""
    bounds, recompute = [0], []
    for st in plan.stages:
        bounds.append(bounds[-1] + st.num_vit_layers + int(st.projector) + st.num_llm_layers)
        rec = {}
        if st.num_vit_layers:
            rec[GROUP_VIT] = st.vit_recompute
        if st.num_llm_layers:
            rec[GROUP_LLM] = st.llm_recompute
        recompute.append(rec)
    return tuple(bounds), recompute


def baseline_plan(request: PlanRequest, search: BaselineSearch) -> BaselinePlan | None:
    """plan.json's record of the best hand-set Megatron-LM configuration (None: none fits)."""
    if search.best is None:
        return None
    c, part, result = search.best.config, search.best.part, search.best.result
    return BaselinePlan(
        tp=c.tp,
        pp=c.pp,
        dp=c.dp,
        micro_batch_size=c.micro_batch_size,
        micro_batches=c.micro_batches,
        llm_layers_per_stage=c.llm_layers,
        recompute_vision=c.recompute_vision,
        recompute_num_layers=c.recompute_num_layers,
        step_ms=_ms(result.step_ms),
        bubble_fraction=round(result.bubble_fraction, 4),
        peak_memory_gib=tuple(round(float(x) / GIB_MIB, 3) for x in part.memory_mib[: c.pp]),
        configurations_searched=search.searched,
        configurations_fitting=search.fitting,
        megatron_flags=tuple(
            baseline_flags(
                request.model,
                c.tp,
                c.pp,
                c.micro_batch_size,
                request.global_batch,
                c.llm_layers,
                c.recompute_vision,
                c.recompute_num_layers,
                c.vpp,
                c.ep,
            )
        ),  # fmt: skip
        vpp=c.vpp,
        ep=c.ep,
    )


def baseline_on_balanced_data(request: PlanRequest, config: BaselineConfig) -> Evaluated | None:
    """The hand-set baseline's own configuration (parallel sizes, micro-batch count, LLM split,
    recompute and schedule) on balanced micro-batches, where the request admits it (its fixed
    TP, PP, micro-batches and model chunks per rank) and it fits memory; else None.

    Why: the plan is compared with that baseline, and the search's own splits need not include
    the baseline's (an interleaved baseline's is screened with the search's other candidates):
    with this candidate the plan is never predicted slower than the baseline wherever the
    request allows the baseline's configuration."""
    fixed = (request.tp, request.pp, request.micro_batches, request.vpp, request.ep)
    own = (config.tp, config.pp, config.micro_batches, config.vpp, config.ep)
    if any(f is not None and f != o for f, o in zip(fixed, own, strict=True)):
        return None  # (a request with packing levels is vpp 1: PlanRequest refuses the rest)
    try:
        setting = make_setting(request, config.tp, config.pp, config.dp, config.micro_batches,
                               ep=config.ep)  # fmt: skip
    except ValueError:  # no balanced micro-batches at these sizes (the search says why)
        return None
    problem = setting.problem(budget_mib(request.hardware))
    part = evaluate_config(problem, config, request.model.vit.num_layers)
    if not problem.fits(part):
        return None
    return Evaluated(setting, part, setting.predict(part, setting.balanced))


def make_plan(request: PlanRequest, progress: bool = False) -> Plan:
    """The plan for the fastest feasible configuration of `request`; the hand-set baseline's
    parallel sizes and micro-batch count are among those searched."""
    search = best_megatron_baseline(request)
    c = search.best.config if search.best is not None else None
    also = None if c is None else (c.tp, c.pp, c.dp, c.micro_batches)
    best = plan_candidates(request, progress, also)[0]
    own = None if c is None else baseline_on_balanced_data(request, c)
    if own is not None and own.result.step_ms < best.result.step_ms:
        best = own
    st, model = best.setting, request.model
    step = _ms(best.result.step_ms)
    base = baseline_plan(request, search)
    same_part, same, same_fits = same_parallel_baseline(st)
    levels = None
    if request.levels is not None:
        top = Level(vit_budget=st.vit_budget, token_budget=st.token_budget, micro_batches=st.m)
        levels = plan_levels(pipeline(st, best.part.bounds), request.lengths, top,
                             request.levels)
    prediction = Prediction(
        step_ms=step,
        bubble_fraction=round(best.result.bubble_fraction, 4),
        sync_ms=_ms(best.result.sync_ms),
        speedup=None if base is None else round(base.step_ms / step, 4),
        baseline=base,
        same_parallel=SameParallelBaseline(
            step_ms=_ms(same.step_ms),
            bubble_fraction=round(same.bubble_fraction, 4),
            fits_memory=same_fits,
            unit_ranges=tuple(same_part.stages),
            speedup=round(same.step_ms / best.result.step_ms, 4),
        ),
        partition_mode=request.mode,
        cost_model="analytic" if request.profile is None else "measured profile",
        profile_path=request.profile_path,
        profile_sha256=None if request.profile is None else profile_sha256(request.profile),
        levels=() if levels is None else levels.predictions,
        epoch_s=None if levels is None else levels.epoch_s,
        single_level_epoch_s=None if levels is None else levels.single_level_epoch_s,
    )
    return Plan(
        model_spec=model,
        hardware_spec=request.hardware,
        parallel=ParallelSizes(
            tp=st.tp, pp=st.pp, dp=st.dp, vpp=best.part.vpp, micro_batches=st.m, gpus=request.gpus,
            ep=st.ep,
        ),  # fmt: skip
        stages=stage_plans(model, best.part),
        data=DataPlan(
            vit_budget=st.vit_budget,
            token_budget=st.token_budget,
            global_batch_samples=request.global_batch,
            seed=request.seed,
            num_samples=len(request.lengths),
            lengths_path=request.lengths_path,
            lengths_sha256=lengths_sha256(request.lengths),
            pack_cost=pack_cost(st.model, best.part.bounds, list(best.part.recompute)),
            levels=() if levels is None else levels.levels,
        ),
        predicted=prediction,
        megatron_flags=tuple(
            plan_flags(model, st.tp, st.pp, st.dp, st.m, st.token_budget, request.plan_path,
                       st.ep)  # fmt: skip
        ),
    )
