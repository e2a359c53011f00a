"""The planner's search over parallel sizes: (TP, PP, DP, micro-batches, model chunks per rank,
expert parallel size of a mixture-of-experts LLM), each partitioned.

Each configuration gets its balanced micro-batches and a partition with per-stage recompute;
with many configurations each is screened with a quick search and the best few are searched
in full. Configurations that cannot beat the best so far even without any bubble are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_omnibal.planner.search.parallel_sizes import (
    ep_candidates,
    micro_batch_candidates,
    parallel_candidates,
    vpp_candidates,
)
from megatron_omnibal.planner.search.partition import NoFeasiblePartition, Partition
from megatron_omnibal.planner.search.request import PlanRequest
from megatron_omnibal.planner.search.setting import Setting, choose_partition, make_setting
from megatron_omnibal.planner.simulator.simulate import StepResult

FINALISTS = 3
FINALIST_MARGIN = 0.05  # a full search never gained more than ~2% over the quick screen


@dataclass(frozen=True)
class Evaluated:
    setting: Setting
    part: Partition
    result: StepResult


def plan_candidates(
    request: PlanRequest, progress: bool = False, also: tuple[int, ...] | None = None
) -> list[Evaluated]:
    """Feasible (tp, pp, dp, m, vpp, ep) with their partition and predicted step, fastest first.

    `also`: a (tp, pp, dp, micro-batches) searched as well where the request leaves those sizes
    open (the hand-set baseline's: the plan can then always take the baseline's parallel sizes
    and micro-batch count, with balanced micro-batches and a searched partition).
    Finalists screened over FINALIST_MARGIN slower than the best fully searched one are not
    searched in full. A measured profile fixes TP at 1 (it was measured on one GPU).
    """
    model, hw, gb, mode = request.model, request.hardware, request.global_batch, request.mode

    def counts(t: int, p: int, d: int) -> list[int]:
        if request.micro_batches:
            return [request.micro_batches]
        found = micro_batch_candidates(p, gb // d)
        if also is not None and also[:3] == (t, p, d) and also[3] not in found:
            found.append(also[3])
        return found

    configs = [
        (t, p, d, m, v, e)
        for t, p, d in parallel_candidates(model, hw, request.gpus, request.search_tp, request.pp)
        if gb // d >= 1
        for m in counts(t, p, d)
        for v in vpp_candidates(model, p, m, request.vpp)
        for e in ep_candidates(model, d, request.search_ep)
    ]
    fixed = request.tp is not None and request.pp is not None
    if progress and len(configs) > 4:
        from tqdm import tqdm

        configs = tqdm(configs, desc="plan: parallel sizes", unit="config")
    out, errors = [], []
    best = np.inf
    settings: dict[tuple[int, int, int, int, int], Setting] = {}
    for t, p, d, m, v, e in configs:
        at = f"tp={t} pp={p} dp={d} m={m}" + (f" vpp={v}" if v > 1 else "") + (
            f" ep={e}" if e > 1 else "")
        try:
            if (t, p, d, m, e) not in settings:
                settings[(t, p, d, m, e)] = make_setting(request, t, p, d, m, ep=e)
            setting = settings[(t, p, d, m, e)]
            if setting.ideal_ms() >= best:  # even a bubble-free perfect split would lose
                continue
            part, _ = choose_partition(setting, mode, quick=len(configs) > 1, vpp=v)
        except NoFeasiblePartition as exc:
            errors.append(f"{at}: {exc}")
            continue
        except ValueError as exc:
            if fixed:
                raise
            errors.append(f"{at}: {exc}")
            continue
        out.append(Evaluated(setting, part, setting.predict(part, setting.balanced)))
        best = min(best, out[-1].result.step_ms)
    if len(configs) > 1 and out:  # screened quickly: search the finalists in full
        out.sort(key=lambda e: e.result.step_ms)
        best = np.inf
        for i, e in enumerate(out[:FINALISTS]):
            if e.result.step_ms > best * (1 + FINALIST_MARGIN):
                break  # the full search gains a few % at most: this one cannot catch up
            part, _ = choose_partition(e.setting, mode, vpp=e.part.vpp)
            out[i] = Evaluated(e.setting, part, e.setting.predict(part, e.setting.balanced))
            best = min(best, out[i].result.step_ms)
    if not out:
        detail = errors[0] if len(errors) == 1 else "\n  ".join(["", *errors[:8]])
        raise NoFeasiblePartition(
            f"no feasible plan for {model.name} on {request.gpus} x {hw.name}: {detail}"
        )
    return sorted(out, key=lambda e: e.result.step_ms)
