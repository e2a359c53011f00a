"""Pipeline layouts: from plan.json and from per-stage counts, and every way to get one wrong.

Pure Python (no torch): a bad layout must fail here, before any process group exists.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_omnibal.megatron.stages.layout import (
    LayoutError,
    StageLayout,
    layout_from_counts,
    layout_from_plan,
    parse_counts,
)
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.planner.cost_model.hardware import get_hardware
from megatron_omnibal.planner.plan_file.plan import (
    DataPlan,
    ParallelSizes,
    Plan,
    PlanError,
    Prediction,
    SameParallelBaseline,
    StagePlan,
)


def plan_stage(r, vit, llm, pe=False, pj=False, emb=False, head=False, vr=0, lr=0):
    return StagePlan(stage=r, vit_layers=vit, llm_layers=llm, patch_embed=pe, projector=pj,
                     llm_embed=emb, head=head, vit_recompute=vr, llm_recompute=lr,
                     forward_ms=1.0, backward_ms=2.0, peak_memory_gib=3.0)  # fmt: skip


def make_plan(stages, model: str = "internvl-6b-20b") -> Plan:
    """A plan.json's Plan with the given stages (predictions are placeholders)."""
    pp = len(stages)
    return Plan(
        model_spec=get_preset(model),
        hardware_spec=get_hardware("A100-80G"),
        parallel=ParallelSizes(tp=1, pp=pp, dp=8, micro_batches=16, gpus=8 * pp),
        stages=tuple(stages),
        data=DataPlan(vit_budget=9, token_budget=2560, global_batch_samples=1024, seed=0,
                      num_samples=100, lengths_path=None, lengths_sha256="0" * 64),
        predicted=Prediction(
            step_ms=1.0, bubble_fraction=0.1, sync_ms=0.0, speedup=None, baseline=None,
            same_parallel=SameParallelBaseline(step_ms=2.0, bubble_fraction=0.5, fits_memory=True,
                                               unit_ranges=((0, 58), (58, 70), (70, 82), (82, 94)),
                                               speedup=2.0),
            partition_mode="exact", cost_model="analytic"),
        megatron_flags=(),
    )  # fmt: skip


STAGES = [
    plan_stage(0, (0, 30), (0, 0), pe=True, vr=30),
    plan_stage(1, (30, 45), (0, 10), pj=True, emb=True, vr=5, lr=2),
    plan_stage(2, (45, 45), (10, 29)),
    plan_stage(3, (45, 45), (29, 48), head=True),
]
PLAN = make_plan(STAGES)


def test_counts_flags_example_from_the_issue() -> None:
    st = layout_from_counts([30, 15, 0, 0], [0, 10, 19, 19], vit_layers=45, llm_layers=48)
    assert [s.vit_layers for s in st] == [(0, 30), (30, 45), (45, 45), (45, 45)]
    assert [s.llm_layers for s in st] == [(0, 0), (0, 10), (10, 29), (29, 48)]
    assert [s.patch_embed for s in st] == [True, False, False, False]
    # projector and LLM embedding go with the last ViT layer; head on the last stage
    assert [s.projector for s in st] == [False, True, False, False]
    assert [s.llm_embed for s in st] == [False, True, False, False]
    assert [s.head for s in st] == [False, False, False, True]


def test_plan_and_counts_agree() -> None:
    from_plan = layout_from_plan(PLAN, pp_size=4)
    from_counts = layout_from_counts(
        [30, 15, 0, 0], [0, 10, 19, 19], [30, 5, 0, 0], [0, 2, 0, 0], 45, 48
    )
    assert from_plan == from_counts
    assert from_plan[1] == StageLayout((30, 45), (0, 10), False, True, True, False, 5, 2)


def test_plan_for_another_pipeline_size() -> None:
    with pytest.raises(LayoutError, match="pipeline size 4.*this run has.*2"):
        layout_from_plan(PLAN, pp_size=2)


def test_plan_for_another_model() -> None:
    with pytest.raises(LayoutError, match="llm layers add up to 48 over 4 stages, the model has"):
        layout_from_plan(PLAN, pp_size=4, llm_layers=40)


def test_projector_may_sit_between_vit_and_llm() -> None:
    stages = list(STAGES)
    stages[1] = replace(stages[1], llm_layers=(0, 0), projector=False, llm_embed=False,
                        llm_recompute=0)  # fmt: skip
    stages[2] = replace(stages[2], llm_layers=(0, 29), projector=True, llm_embed=True)
    st = layout_from_plan(make_plan(stages), pp_size=4)
    assert st[2].projector and st[2].llm_embed and not st[1].projector


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.__setitem__(3, replace(s[3], llm_layers=(29, 47))), "48 LLM layers|47/48"),
        (lambda s: s.__setitem__(2, replace(s[2], llm_layers=(11, 29))),
         r"stages\[2\].llm_layers \[11, 29\] does not continue at layer 10"),
        (lambda s: s.__setitem__(3, replace(s[3], head=False)), "head must be true on the last"),
        (lambda s: (s.__setitem__(1, replace(s[1], projector=False, llm_embed=False)),
                    s.__setitem__(2, replace(s[2], projector=True, llm_embed=True))),
         r"stages\[1\]: LLM layers before the projector"),
        (lambda s: s.__setitem__(2, replace(s[2], stage=5)), r"stages\[2\].stage is 5"),
    ],
)  # fmt: skip
def test_plans_that_cannot_build_the_model_are_refused_by_the_plan(edit, message) -> None:
    """The Plan validates its own stages (the Megatron side builds layouts only from valid
    plans); messages name the stage and field."""
    stages = list(STAGES)
    with pytest.raises(PlanError, match=message):
        edit(stages)
        make_plan(stages)


def test_counts_that_do_not_add_up() -> None:
    with pytest.raises(
        LayoutError, match="vit layers add up to 44 over 4 stages, the model has 45"
    ):
        layout_from_counts([30, 14, 0, 0], [0, 10, 19, 19], vit_layers=45, llm_layers=48)


def test_negative_count() -> None:
    with pytest.raises(LayoutError, match="--omnibal-llm-pp-layers: stage 2 has a negative"):
        layout_from_counts([30, 15, 0, 0], [0, 30, -1, 19])


def test_count_lists_of_different_lengths() -> None:
    with pytest.raises(LayoutError, match="4 stages, --omnibal-llm-pp-layers 3"):
        layout_from_counts([30, 15, 0, 0], [0, 24, 24])


def test_recompute_above_layers() -> None:
    with pytest.raises(LayoutError, match="stage 1: llm_recompute=11 but the stage holds 10"):
        layout_from_counts([30, 15, 0, 0], [0, 10, 19, 19], llm_recompute=[0, 11, 0, 0])


def test_llm_layers_before_the_projector() -> None:
    with pytest.raises(LayoutError, match="projector on stage 1 comes after the first LLM"):
        layout_from_counts([30, 15], [10, 38])


def test_empty_middle_stage() -> None:
    with pytest.raises(LayoutError, match="stage 1: holds nothing"):
        layout_from_counts([45, 0, 0], [10, 0, 38])


def test_parse_counts() -> None:
    assert parse_counts("30,15,0,0", "--omnibal-vit-pp-layers") == [30, 15, 0, 0]
    with pytest.raises(LayoutError, match="--omnibal-vit-pp-layers: expected comma-separated"):
        parse_counts("30;15", "--omnibal-vit-pp-layers")


def test_layout_module_imports_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, megatron_omnibal.megatron.stages.layout; "
        "sys.exit(int('torch' in sys.modules or 'megatron.core' in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_plan_written_before_the_shared_stage_type_loads_to_the_same_layouts() -> None:
    """tests/data/plan_v2_before_one_layout.json was written by `save_plan` of PLAN before plan
    stages and training stages became one type: it still loads, its stages are the training
    stages (no conversion), and they give the layouts recorded then."""
    from pathlib import Path

    from megatron_omnibal.planner.plan_file.plan import load_plan

    path = Path(__file__).resolve().parents[2] / "data" / "plan_v2_before_one_layout.json"
    old = load_plan(path)
    assert old == PLAN
    assert all(isinstance(st, StageLayout) for st in old.stages)
    recorded = [  # layout_from_plan(PLAN, 4) as printed before the change
        ((0, 30), (0, 0), True, False, False, False, 30, 0),
        ((30, 45), (0, 10), False, True, True, False, 5, 2),
        ((45, 45), (10, 29), False, False, False, False, 0, 0),
        ((45, 45), (29, 48), False, False, False, True, 0, 0),
    ]
    assert layout_from_plan(old, pp_size=4) == [StageLayout(*row) for row in recorded]
