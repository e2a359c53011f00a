"""`--calibrate`: the measurement as a layer profile the planner reads, and the plan made again
from it, with what changed.

Why: the planner's analytic model leaves out what a real run on these GPUs measures (kernel
efficiency at these shapes, attention at packed lengths, launch overheads, the pipeline's sends
and receives). Per stage, each tower's layers' forward time per micro-batch is fitted over every
measured micro-batch (the largest of a level and the balanced stream's): ViT layers per tile
plus a fixed part, LLM layers per token, per squared length their attention runs over and a
fixed part, a fixed part kept where the measurements support it (fit.supported_fit). The work
outside the layers (patch embedding, projector and LLM embedding, head and loss, the
micro-batch's data) is the forward step's time less its layers', fitted per tile (given to the
projector on its stage, else to the stage's first ViT layer) or per token (to its last LLM
layer), as `omnibal profile` folds it; a stage's backward is its forward times the ratio
measured on it. The point-to-point time is the one with which the planner's
simulator spans the measured pipeline (fit.fit_p2p_ms), the per-step fixed cost the first
stage's step outside its schedule. The profile holds these at the size of the largest
micro-batch, with the memory its layers measured there. Pure: no torch.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.cost_model.memory import static_bytes_per_param
from megatron_omnibal.preflight.fit import fit_p2p_ms, supported_fit
from megatron_omnibal.preflight.report import TYPICAL, WORST

if TYPE_CHECKING:
    from megatron_omnibal.planner.plan_file.plan import Plan

MIB_PER_GIB = 1024.0
SIZE, SQUARES, FIXED = 0, 1, 2  # a unit's forward ms per tile or token, per squared length, fixed


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
    """The layer profile of the preflight `report`, at a micro-batch of `tiles` and `tokens` in
    one sample (the largest one measured); `layouts[s]` is stage s's StageLayout as a dict."""
    if tiles < 1 or tokens < 1:
        raise ValueError(f"--calibrate needs a largest micro-batch with tiles and tokens (got "
                         f"{tiles} tiles, {tokens} tokens) to scale the profile")  # fmt: skip
    towers: dict[str, dict[int, dict[str, Any]]] = {"vit": {}, "llm": {}}
    projector: dict[str, Any] = {"coef": np.zeros(3), "ratio": 0.0, "activation_mib": 0.0,
                                 "checkpoint_mib": 0.0}  # fmt: skip
    for st, lay in zip(report["stages"], layouts, strict=True):
        m = st["measured"]
        sample = _micro_batches(timing_runs(m["runs"]))
        if sample is None:
            raise ValueError(f"--calibrate: stage {st['stage']} has no timed micro-batch "
                             "(give --typical-steps or --worst-steps 1 or more)")  # fmt: skip
        features, call, tower_ms, backward = sample
        ratio = float(backward.sum() / call.sum())
        held = 0.0
        for tower, key in (("vit", "vit_layers"), ("llm", "llm_layers")):
            first, end = lay[key]
            if end == first:
                continue
            coef = _fit_tower(tower, features, tower_ms[tower] / (end - first))
            for i, (act, inp, _) in enumerate(m["layers"].get(tower, [])):
                towers[tower][first + i] = {"coef": coef.copy(), "ratio": ratio,
                                            "activation_mib": act * MIB_PER_GIB,
                                            "checkpoint_mib": inp * MIB_PER_GIB}  # fmt: skip
                held += act * MIB_PER_GIB
        inflight = min(len(layouts) - st["stage"], micro_batches)
        rest_mib = max(m["activation_gib"] * MIB_PER_GIB / inflight - held, 0.0)
        rest = call - tower_ms["vit"] - tower_ms["llm"]
        if lay["projector"]:
            target, column = projector, 0
        elif lay["vit_layers"][1] > lay["vit_layers"][0]:
            target, column = towers["vit"][lay["vit_layers"][0]], 0
        else:
            target, column = towers["llm"][lay["llm_layers"][1] - 1], 1
        fitted = supported_fit(
            np.stack([features[:, column], np.ones(len(rest))], axis=1), rest)
        target["coef"] += np.array([fitted[0], 0.0, fitted[1]])
        target["ratio"] = ratio
        target["activation_mib"] += rest_mib
    _fill_recomputed(towers)
    reference = {"vit": tiles, "llm": tokens, "none": tiles}
    layers: list[dict[str, Any]] = []
    params = {"vit": spec.vit.layer_params, "llm": spec.llm.layer_params}
    for tower, count in (("vit", spec.vit.num_layers), ("llm", spec.llm.num_layers)):
        for i in range(count):
            layers.append(_layer(f"{tower}.{i}", towers[tower][i], params[tower], tower,
                                 reference[tower], tokens**2))  # fmt: skip
        if tower == "vit":
            p = spec.projector_params + spec.llm.vocab_size * spec.llm.hidden_size
            layers.append(_layer("projector", projector, p, "none", tiles, tokens**2))
    doc: dict[str, Any] = {
        "micro_batches": micro_batches, "layers": layers,
        "measured": {"tiles": tiles, "tokens": tokens, "sumsq": tokens**2},
        # the first stage's schedule spans the pipeline; the rest of its step is per-step work
        "step_overhead_ms": report["stages"][0]["measured"]["outside_schedule_ms"],
        "source": "python -m megatron_omnibal.preflight --calibrate"}  # fmt: skip
    p2p = pipeline_p2p_ms(report)
    if p2p is not None:
        doc["p2p_ms"] = p2p
    if memory_budget_gib is not None:
        doc["memory_budget_gib"] = memory_budget_gib
    return doc


def timing_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps whose times are fitted: the spread and typical steps where there are any, not
    the worst steps. A worst step's micro-batches are all of one size, the largest, measured
    under one moment's load: the fit's growth beyond the balanced sizes pivots on that one
    point, and a few % of load there bends it into tens of % at a padded micro-batch's length
    (with 5% noise per step, 3% per micro-batch, simulated: mean error 15% at 1.65 times the
    token budget from the worst and balanced steps, 4% from the two spread steps and the
    balanced ones). The spread steps measure the largest size too, beside smaller ones under
    the same load."""
    kept = [r for r in runs if not r["label"].startswith(WORST)]
    return kept or runs


def _micro_batches(runs: list[dict[str, Any]]) -> tuple[
        np.ndarray, np.ndarray, dict[str, np.ndarray], np.ndarray] | None:  # fmt: skip
    """Every timed micro-batch of a stage's runs: features (n, 3) [tiles, tokens, squared
    lengths attended], forward step ms, per tower its layers' forward ms, backward ms."""
    rows = [(b, c, k, {t: r["tower_ms"].get(t, []) for t in ("vit", "llm")})
            for r in runs for k, (b, c) in enumerate(zip(r["batches"], r["call_ms"],
                                                         strict=False))]  # fmt: skip
    backward = [ms for r in runs for ms in r["backward_ms"][:len(r["call_ms"])]]
    if not rows or len(backward) != len(rows):
        return None
    towers = {t: np.array([ms[t][k] if k < len(ms[t]) else 0.0 for _, _, k, ms in rows])
              for t in ("vit", "llm")}  # fmt: skip
    return (np.array([b for b, *_ in rows], np.float64), np.array([c for _, c, *_ in rows]),
            towers, np.array(backward))  # fmt: skip


def _fit_tower(tower: str, features: np.ndarray, layer_ms: np.ndarray) -> np.ndarray:
    """[per tile or token, per squared length, fixed] ms of one layer: ViT layers attend
    within a tile (no squared term); LLM layers over the packed samples."""
    ones = np.ones(len(layer_ms))
    if tower == "vit":
        a, fixed = supported_fit(np.stack([features[:, 0], ones], axis=1), layer_ms)
        return np.array([a, 0.0, fixed])
    return supported_fit(np.stack([features[:, 1], features[:, 2], ones], axis=1), layer_ms,
                         always=2)  # fmt: skip


def pipeline_p2p_ms(report: dict[str, Any]) -> float | None:
    """The median over the typical steps (else every measured step) of the point-to-point time
    that spans the first stage's measured schedule (fit.fit_p2p_ms); None at PP 1."""
    per_stage = [st["measured"]["runs"] for st in report["stages"]]
    if len(per_stage) < 2:
        return None
    steps = list(zip(*per_stage, strict=True))
    chosen = [s for s in steps if s[0]["label"] == TYPICAL] or steps
    fits = []
    for step in chosen:
        forward = [r["call_ms"] for r in step]
        backward = [r["backward_ms"] for r in step]
        if len({len(x) for x in forward + backward}) != 1 or not forward[0]:
            continue
        fits.append(fit_p2p_ms(np.array(forward), np.array(backward), step[0]["schedule_ms"]))
    return median(fits) if fits else None


def _fill_recomputed(towers: dict[str, dict[int, dict[str, Any]]]) -> None:
    """A recomputed layer stores nothing in its first forward, so its activations were not seen:
    it gets its tower's largest measured ones (a tower's layers have the same shapes)."""
    for rows in towers.values():
        seen = [r["activation_mib"] for r in rows.values() if r["activation_mib"] > 0]
        for r in rows.values():
            if r["activation_mib"] <= 0 < len(seen):
                r["activation_mib"] = max(seen)


def _layer(name: str, row: dict[str, Any], params: int, group: str, size: int,
           squares: int) -> dict[str, Any]:  # fmt: skip
    """A profile layer at a micro-batch of `size` tiles or tokens in one sample (`squares`)."""
    a, c, fixed = row["coef"]
    forward = a * size + c * squares + fixed
    return {"name": name, "forward_ms": forward, "backward_ms": forward * row["ratio"],
            "recompute_ms": forward, "attention_ms": c * squares, "fixed_ms": fixed,
            "activation_mib": row["activation_mib"],
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
