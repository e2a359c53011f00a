"""Which part of the VLM lives on which pipeline stage.

Why a separate module: the layout comes from a plan.json (planner.plan.Plan, which validates its
own stages) or from two flags, and every way of getting it wrong (layers that don't add up, a
plan for another PP size or model, recompute above the layer count) must stop with a clear
message BEFORE any process group exists, where a wrong layout would otherwise hang a pipeline.
Pure Python: no torch, no Megatron.

The stage type itself, StageLayout, lives in planner/plan_file/stage_layout.py (plan.json's
stages are the same type): import it from there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from megatron_omnibal.balance.config import Level
from megatron_omnibal.planner.plan_file.plan import Plan
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout


class LayoutError(ValueError):
    """A pipeline layout that cannot build the model; the message says what and where."""


def validate_layout(
    layouts: Sequence[StageLayout], vit_layers: int | None = None, llm_layers: int | None = None
) -> None:
    """Raise LayoutError unless `layouts` is a complete, ordered, buildable split of the model.

    `vit_layers` / `llm_layers` are the model's layer counts; None skips that check (the totals
    are then whatever the layout covers).
    """
    if not layouts:
        raise LayoutError("pipeline layout: no stages")
    for tower, total in (("vit", vit_layers), ("llm", llm_layers)):
        pos = 0
        for r, st in enumerate(layouts):
            first, end = getattr(st, f"{tower}_layers")
            if first < 0 or end < first:
                raise LayoutError(
                    f"stage {r}: {tower}_layers [{first}, {end}) is not a range "
                    "(negative or reversed)"
                )
            if end > first and first != pos:
                raise LayoutError(
                    f"stage {r}: {tower}_layers [{first}, {end}) does not continue where the "
                    f"previous stages ended ({pos}); ranges must be contiguous and in order"
                )
            pos = max(pos, end)
            rec = getattr(st, f"{tower}_recompute")
            if rec < 0 or rec > end - first:
                raise LayoutError(
                    f"stage {r}: {tower}_recompute={rec} but the stage holds {end - first} "
                    f"{tower} layers"
                )
        if total is not None and pos != total:
            raise LayoutError(
                f"pipeline layout: {tower} layers add up to {pos} over {len(layouts)} stages, "
                f"the model has {total}"
            )
    for flag in ("patch_embed", "projector", "llm_embed", "head"):
        owners = [r for r, st in enumerate(layouts) if getattr(st, flag)]
        if len(owners) != 1:
            raise LayoutError(
                f"pipeline layout: '{flag}' must be on exactly one stage, is on {owners or 'none'}"
            )
    pe, pj, emb, hd = (
        next(r for r, st in enumerate(layouts) if getattr(st, f))
        for f in ("patch_embed", "projector", "llm_embed", "head")
    )
    if pe != 0:
        raise LayoutError(f"pipeline layout: patch_embed is on stage {pe}, must be on stage 0")
    if hd != len(layouts) - 1:
        raise LayoutError(
            f"pipeline layout: head is on stage {hd}, must be on the last stage {len(layouts) - 1}"
        )
    if emb != pj:
        raise LayoutError(
            f"pipeline layout: llm_embed (stage {emb}) must be on the projector's stage ({pj})"
        )
    vit_stages = [r for r, st in enumerate(layouts) if st.num_vit_layers > 0]
    llm_stages = [r for r, st in enumerate(layouts) if st.num_llm_layers > 0]
    last_vit = vit_stages[-1] if vit_stages else 0
    if pj < last_vit:
        raise LayoutError(
            f"pipeline layout: projector on stage {pj} comes before the last ViT layer "
            f"(stage {last_vit})"
        )
    if llm_stages and pj > llm_stages[0]:
        raise LayoutError(
            f"pipeline layout: projector on stage {pj} comes after the first LLM layer "
            f"(stage {llm_stages[0]})"
        )
    for r, st in enumerate(layouts):
        empty = (
            st.num_vit_layers == 0
            and st.num_llm_layers == 0
            and not (st.patch_embed or st.projector or st.llm_embed or st.head)
        )
        if empty:
            raise LayoutError(f"stage {r}: holds nothing (no layers, embedding, projector or head)")


def layout_from_plan(
    plan: Plan,
    pp_size: int,
    vit_layers: int | None = None,
    llm_layers: int | None = None,
    vit_recompute: Sequence[int] | None = None,
    llm_recompute: Sequence[int] | None = None,
) -> list[StageLayout]:
    """The (virtual) stages of a (validated) plan, checked against the run's PP size and model,
    with per-stage recompute counts given by flags in place of the plan's (None: the plan's).
    A plan with vpp > 1 gives pp x vpp virtual stages in model order (rank_stages says which
    a rank builds).

    Model layer counts default to the plan's model_spec.
    """
    if plan.parallel.pp != pp_size:
        raise LayoutError(
            f"plan is for pipeline size {plan.parallel.pp}, this run has "
            f"--pipeline-model-parallel-size {pp_size}"
        )
    stages = len(plan.stages)
    for flag, counts in (("vit recompute", vit_recompute), ("llm recompute", llm_recompute)):
        if counts is not None and len(counts) != stages:
            raise LayoutError(f"{flag}: {len(counts)} values for the plan's {stages} stages")
    spec = plan.model_spec
    out = [
        replace(
            s.layout,
            vit_recompute=s.vit_recompute if vit_recompute is None else vit_recompute[r],
            llm_recompute=s.llm_recompute if llm_recompute is None else llm_recompute[r],
        )
        for r, s in enumerate(plan.stages)
    ]
    validate_layout(
        out,
        spec.vit.num_layers if vit_layers is None else vit_layers,
        spec.llm.num_layers if llm_layers is None else llm_layers,
    )
    return out


def rank_stages(num_stages: int, pp: int, rank: int) -> list[int]:
    """The virtual stages pipeline rank `rank` builds, one per model chunk, in chunk order:
    Megatron's interleaved placement gives chunk c of rank r virtual stage c x pp + r (with one
    chunk per rank, just the rank)."""
    if num_stages % pp:
        raise LayoutError(f"{num_stages} stages do not divide over {pp} pipeline ranks")
    return list(range(rank, num_stages, pp))


def parse_counts(text: str, flag: str) -> list[int]:
    """'30,15,0,0' -> [30, 15, 0, 0], with an error naming the flag."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise LayoutError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def layout_from_counts(
    vit_counts: Sequence[int],
    llm_counts: Sequence[int],
    vit_recompute: Sequence[int] | None = None,
    llm_recompute: Sequence[int] | None = None,
    vit_layers: int | None = None,
    llm_layers: int | None = None,
) -> list[StageLayout]:
    """Stages from per-stage layer counts (`--omnibal-vit-pp-layers 30,15,0,0` and friends).

    The projector and LLM embedding go on the stage of the last ViT layer (stage 0 when the ViT
    has no layers), the head on the last stage.
    """
    pp = len(vit_counts)
    if len(llm_counts) != pp:
        raise LayoutError(
            f"--omnibal-vit-pp-layers has {pp} stages, --omnibal-llm-pp-layers {len(llm_counts)}"
        )
    vit_rec = list(vit_recompute) if vit_recompute is not None else [0] * pp
    llm_rec = list(llm_recompute) if llm_recompute is not None else [0] * pp
    for name, seq in (("vit recompute", vit_rec), ("llm recompute", llm_rec)):
        if len(seq) != pp:
            raise LayoutError(f"{name}: {len(seq)} values for {pp} stages")
    for name, seq in (
        ("--omnibal-vit-pp-layers", vit_counts),
        ("--omnibal-llm-pp-layers", llm_counts),
    ):
        bad = [(r, c) for r, c in enumerate(seq) if c < 0]
        if bad:
            raise LayoutError(f"{name}: stage {bad[0][0]} has a negative count {bad[0][1]}")
    vit_stages = [r for r, c in enumerate(vit_counts) if c > 0]
    proj = vit_stages[-1] if vit_stages else 0
    out, v, t = [], 0, 0
    for r in range(pp):
        out.append(
            StageLayout(
                vit_layers=(v, v + vit_counts[r]),
                llm_layers=(t, t + llm_counts[r]),
                patch_embed=r == 0,
                projector=r == proj,
                llm_embed=r == proj,
                head=r == pp - 1,
                vit_recompute=vit_rec[r],
                llm_recompute=llm_rec[r],
            )
        )
        v += vit_counts[r]
        t += llm_counts[r]
    validate_layout(out, vit_layers, llm_layers)
    return out


def level_recompute(
    layouts: Sequence[StageLayout], levels: Sequence[Level]
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, the (ViT, LLM) layers it recomputes in a step of each packing level: the
    level's per-stage counts where it gives them, else the stage's own (layout) counts."""
    pp = len(layouts)
    for i, lv in enumerate(levels):
        for name, counts in (("vit", lv.vit_recompute), ("llm", lv.llm_recompute)):
            if counts and len(counts) != pp:
                raise LayoutError(
                    f"level {i} ({lv.vit_budget}/{lv.token_budget}): {name}_recompute has "
                    f"{len(counts)} stages, the pipeline {pp}"
                )
    out = []
    for r, st in enumerate(layouts):
        row = []
        for i, lv in enumerate(levels):
            vit = lv.vit_recompute[r] if lv.vit_recompute else st.vit_recompute
            llm = lv.llm_recompute[r] if lv.llm_recompute else st.llm_recompute
            if vit > st.num_vit_layers or llm > st.num_llm_layers:
                raise LayoutError(
                    f"level {i} ({lv.vit_budget}/{lv.token_budget}): stage {r} would recompute "
                    f"{vit} ViT / {llm} LLM layers, it holds {st.num_vit_layers} / "
                    f"{st.num_llm_layers}"
                )
            row.append((vit, llm))
        out.append(tuple(row))
    return tuple(out)


def embedding_ranks(layouts: Sequence[StageLayout], pp: int) -> Callable[..., list[int]]:
    """Megatron's `get_embedding_ranks` for this layout: the rank holding the word embedding
    (the projector's stage) and the head's, so a tied output head's gradient is summed with the
    embedding's (parallel_state assumes the first and last stage). `layouts` may be virtual
    stages (virtual stage v lives on rank v % pp)."""
    embed = next(r for r, st in enumerate(layouts) if st.llm_embed) % pp

    def ranks(pp_ranks: list[int], *_: Any) -> list[int]:
        return sorted({pp_ranks[embed], pp_ranks[-1]})

    return ranks


def megatron_layout(layouts: Sequence[StageLayout], tower: str) -> list[list[str]]:
    """One tower's layers per stage as megatron-core's `pipeline_model_parallel_layout` spells
    them (embedding first, loss last, "decoder" per layer): how Megatron learns the real,
    possibly uneven split, so that it numbers, counts and checkpoints the layers as built. With
    virtual stages (pp x vpp of them, in model order) Megatron reads the vpp from the count."""
    rows = []
    for r, st in enumerate(layouts):
        row = (["embedding"] if r == 0 else []) + ["decoder"] * getattr(st, f"num_{tower}_layers")
        rows.append(row + (["loss"] if r == len(layouts) - 1 else []))
    return rows


def megatron_layout_flag(layouts: Sequence[StageLayout]) -> str:
    """The LLM's split as megatron.training's `--pipeline-model-parallel-layout` string
    ("Et|ttttL" for LLM layers 1,4): it replaces Megatron's even split (and the check that the
    layers divide by the pipeline size) with the run's layout."""
    letters = {"embedding": "E", "decoder": "t", "loss": "L"}
    return "|".join(
        "".join(letters[kind] for kind in row) for row in megatron_layout(layouts, "llm")
    )


def layout_from_dicts(
    stages: Sequence[dict[str, Any]], vit_layers: int, llm_layers: int, where: str
) -> list[StageLayout]:
    """Stages written by StageLayout.to_dict (a checkpoint's record), checked."""
    try:
        out = [
            StageLayout(
                **{**s, "vit_layers": tuple(s["vit_layers"]), "llm_layers": tuple(s["llm_layers"])}
            )
            for s in stages
        ]
    except (KeyError, TypeError) as exc:
        raise LayoutError(f"{where}: not a stage layout ({exc})") from None
    validate_layout(out, vit_layers, llm_layers)
    return out
