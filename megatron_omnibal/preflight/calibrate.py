"""`--calibrate`: the preflight's measurement as a layer profile the planner reads, and the plan
made again from it, with what changed.

Why: the planner's analytic model leaves out what a real run on these GPUs measures (kernel
efficiency at these shapes, attention at packed lengths, launch overheads). The profile holds,
per layer, what the stages measured, at the size of their largest micro-batch: stored
activations and the input a recomputed layer keeps as measured on it, forward times as measured
on the typical steps' micro-batches and scaled linearly to it; `omnibal plan --profile` scales
it per tile and per token (docs/planner.md). A stage's backward is split over its layers as
their forwards are; the work outside the layers (patch embedding, projector and LLM embedding,
head and loss) is the stage's forward less its layers', given to the projector on its stage,
else to the stage's first ViT or last LLM layer, as `omnibal profile` folds it. Pure: no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.cost_model.memory import static_bytes_per_param

if TYPE_CHECKING:
    from megatron_omnibal.planner.plan_file.plan import Plan

MIB_PER_GIB = 1024.0


def calibrated_profile(
    *,
    report: dict[str, Any],
    spec: ModelSpec,
    layouts: list[dict[str, Any]],
    tiles: int,
    tokens: int,
    micro_batches: int,
    memory_budget_gib: float | None,
) -> dict[str, Any]:
    """The layer profile of the preflight `report` (stages measured on micro-batches of `tiles`
    and `tokens`); `layouts[s]` is stage s's StageLayout as a dict."""
    if tiles < 1 or tokens < 1:
        raise ValueError(f"--calibrate needs a largest micro-batch with tiles and tokens (got "
                         f"{tiles} tiles, {tokens} tokens) to scale the profile")  # fmt: skip
    towers: dict[str, dict[int, dict[str, Any]]] = {"vit": {}, "llm": {}}
    # work outside the layers: (unit kind, layer index, forward ms, activation MiB, bwd / fwd)
    extras: list[tuple[str, int, float, float, float]] = []
    for st, lay in zip(report["stages"], layouts, strict=True):
        m = st["measured"]
        timing = _timing(m, tiles, tokens)
        if timing is None:
            raise ValueError(f"--calibrate: stage {st['stage']} has no timed micro-batch "
                             "(give --typical-steps or --worst-steps 1 or more)")  # fmt: skip
        fwd, bwd, layer_ms, scale = timing
        ratio = bwd / fwd
        layer_sum = 0.0
        held = 0.0
        for tower, key in (("vit", "vit_layers"), ("llm", "llm_layers")):
            first = lay[key][0]
            for i, (act, inp, _) in enumerate(m["layers"].get(tower, [])):
                ms = layer_ms[tower][i]
                towers[tower][first + i] = {"forward_ms": ms * scale[tower],
                                            "backward_ms": ms * scale[tower] * ratio,
                                            "activation_mib": act * MIB_PER_GIB,
                                            "checkpoint_mib": inp * MIB_PER_GIB}  # fmt: skip
                layer_sum += ms
                held += act * MIB_PER_GIB
        inflight = min(len(layouts) - st["stage"], micro_batches)
        rest_ms = max(fwd - layer_sum, 0.0)
        rest_mib = max(m["activation_gib"] * MIB_PER_GIB / inflight - held, 0.0)
        if lay["projector"]:
            where, index, factor = "projector", 0, scale["vit"]
        elif lay["vit_layers"][1] > lay["vit_layers"][0]:
            where, index, factor = "vit", lay["vit_layers"][0], scale["vit"]
        else:
            where, index, factor = "llm", lay["llm_layers"][1] - 1, scale["llm"]
        extras.append((where, index, rest_ms * factor, rest_mib, ratio))
    _fill_recomputed(towers)
    layers: list[dict[str, Any]] = []
    params = {"vit": spec.vit.layer_params, "llm": spec.llm.layer_params}
    projector = {"forward_ms": 0.0, "backward_ms": 0.0, "activation_mib": 0.0,
                 "checkpoint_mib": 0.0}  # fmt: skip
    for where, index, ms, mib, ratio in extras:
        target = projector if where == "projector" else towers[where][index]
        target["forward_ms"] += ms
        target["backward_ms"] += ms * ratio
        target["activation_mib"] += mib
    for tower, count in (("vit", spec.vit.num_layers), ("llm", spec.llm.num_layers)):
        for i in range(count):
            row = towers[tower][i]
            layers.append(_layer(f"{tower}.{i}", row, params[tower], tower))
        if tower == "vit":
            p = spec.projector_params + spec.llm.vocab_size * spec.llm.hidden_size
            layers.append(_layer("projector", projector, p, "none"))
    doc: dict[str, Any] = {
        "micro_batches": micro_batches, "layers": layers,
        "measured": {"tiles": tiles, "tokens": tokens},
        # the first stage's schedule spans the pipeline; the rest of its step is per-step work
        "step_overhead_ms": report["stages"][0]["measured"]["outside_schedule_ms"],
        "source": "python -m megatron_omnibal.preflight --calibrate"}  # fmt: skip
    if memory_budget_gib is not None:
        doc["memory_budget_gib"] = memory_budget_gib
    return doc


def _timing(measured: dict[str, Any], tiles: int, tokens: int) -> tuple[
        float, float, dict[str, list[float]], dict[str, float]] | None:  # fmt: skip
    """(forward ms, backward ms per micro-batch, per tower each layer's forward ms, per tower
    the factor to the profile's micro-batch of `tiles` and `tokens`).

    From the typical steps where they hold tiles and tokens: the balanced stream's micro-batches
    are what the planner predicts, and their times, scaled linearly to the profile's size, hold
    the per-micro-batch work a one-sample largest micro-batch does not show; the forward step's
    work outside the stage's forward (data, the batch's copy, the loss) counts as the stage's
    forward. Else from the largest micro-batch, as measured."""
    batch, layers = measured.get("typical_batch"), measured.get("typical_layers")
    if batch and batch[0] >= 1 and batch[1] >= 1 and measured["forward_ms"] and layers:
        outside = measured.get("outside_forward_ms") or 0.0
        return (measured["forward_ms"] + outside, measured["backward_ms"], layers,
                {"vit": tiles / batch[0], "llm": tokens / batch[1]})  # fmt: skip
    fwd, bwd = measured["worst_forward_ms"], measured["worst_backward_ms"]
    if fwd is None or bwd is None or fwd <= 0:
        return None
    layers = {tower: [ms for *_, ms in rows] for tower, rows in measured["layers"].items()}
    return fwd, bwd, layers, {"vit": 1.0, "llm": 1.0}


def _fill_recomputed(towers: dict[str, dict[int, dict[str, Any]]]) -> None:
    """A recomputed layer stores nothing in its first forward, so its activations were not seen:
    it gets its tower's largest measured ones (a tower's layers have the same shapes)."""
    for rows in towers.values():
        seen = [r["activation_mib"] for r in rows.values() if r["activation_mib"] > 0]
        for r in rows.values():
            if r["activation_mib"] <= 0 < len(seen):
                r["activation_mib"] = max(seen)


def _layer(name: str, row: dict[str, Any], params: int, group: str) -> dict[str, Any]:
    return {"name": name, "forward_ms": row["forward_ms"], "backward_ms": row["backward_ms"],
            "recompute_ms": row["forward_ms"], "activation_mib": row["activation_mib"],
            "weight_mib": params * static_bytes_per_param() / 2**20,
            "checkpoint_mib": row["checkpoint_mib"], "output_mib": row["checkpoint_mib"],
            "params": params, "group": group}  # fmt: skip


def plan_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What re-planning changed, one line each (partition, recompute, budgets, prediction)."""
    lines = []
    for s, (a, b) in enumerate(zip(before["stages"], after["stages"], strict=True)):
        for key in ("vit_layers", "llm_layers", "vit_recompute", "llm_recompute"):
            if a[key] != b[key]:
                lines.append(f"stage {s} {key.replace('_', ' ')}: {a[key]} -> {b[key]}")
    for key in ("vit_budget", "token_budget"):
        if before["data"][key] != after["data"][key]:
            lines.append(f"{key.replace('_', ' ')}: {before['data'][key]} -> "
                         f"{after['data'][key]}")  # fmt: skip
    lines.append(f"predicted step ms: {before['predicted']['step_ms']:.2f} -> "
                 f"{after['predicted']['step_ms']:.2f}")  # fmt: skip
    return lines


def replan(plan: Plan, profile: dict[str, Any], profile_path: Path, out: Path) -> Plan:
    """`plan` made again from the calibrated profile: the same model, GPUs, pipeline size,
    micro-batches, global batch, length file and search, written to `out`."""
    from megatron_omnibal.planner.make import make_plan
    from megatron_omnibal.planner.plan_file.plan import save_plan
    from megatron_omnibal.planner.plan_file.provenance import load_recorded_lengths
    from megatron_omnibal.planner.search.request import PlanRequest

    if plan.data.lengths_path is None:
        raise ValueError("--calibrate: the plan records no length file to plan again from")
    if plan.parallel.tp != 1:
        raise ValueError(f"--calibrate: a layer profile is for TP 1; the plan has tp="
                         f"{plan.parallel.tp}")  # fmt: skip
    lengths = load_recorded_lengths(plan.data.lengths_path, plan.data.lengths_sha256,
                                    "--omnibal-plan")  # fmt: skip
    p = plan.parallel
    request = PlanRequest(
        model=plan.model_spec, hardware=plan.hardware_spec, lengths=lengths,
        lengths_path=plan.data.lengths_path, gpus=p.gpus, tp=1, pp=p.pp,
        micro_batches=p.micro_batches, global_batch=plan.data.global_batch_samples,
        mode=plan.predicted.partition_mode, seed=plan.data.seed, profile=profile,
        profile_path=str(profile_path.resolve()), plan_path=str(out),
    )  # fmt: skip
    new = make_plan(request)
    save_plan(new, out)
    return new
