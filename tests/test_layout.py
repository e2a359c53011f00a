"""Pipeline layouts: from plan.json and from per-stage counts, and every way to get one wrong.

Pure Python (no torch): a bad layout must fail here, before any process group exists.
"""

from __future__ import annotations

import copy

import pytest

from megatron_omnibal.megatron.layout import (
    LayoutError,
    StageLayout,
    layout_from_counts,
    layout_from_plan,
    parse_counts,
)


def plan_stage(r, vit, llm, pe=False, pj=False, emb=False, head=False, vr=0, lr=0):
    return {
        "stage": r,
        "vit_layers": list(vit),
        "llm_layers": list(llm),
        "patch_embed": pe,
        "projector": pj,
        "llm_embed": emb,
        "head": head,
        "vit_recompute": vr,
        "llm_recompute": lr,
        "forward_ms": 1.0,
        "backward_ms": 2.0,
        "peak_memory_gib": 3.0,
    }


PLAN = {
    "version": 1,
    "parallel": {"tp": 1, "pp": 4, "dp": 8, "vpp": 1, "micro_batches": 16, "gpus": 32},
    "model_spec": {"vit": {"num_layers": 45}, "llm": {"num_layers": 48}},
    "stages": [
        plan_stage(0, (0, 30), (0, 0), pe=True, vr=30),
        plan_stage(1, (30, 45), (0, 10), pj=True, emb=True, vr=5, lr=2),
        plan_stage(2, (45, 45), (10, 29)),
        plan_stage(3, (45, 45), (29, 48), head=True),
    ],
}


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


def test_plan_pp_field_disagrees_with_stage_list() -> None:
    plan = copy.deepcopy(PLAN)
    plan["parallel"]["pp"] = 2
    with pytest.raises(LayoutError, match="parallel.pp=2 but it lists 4 stages"):
        layout_from_plan(plan, pp_size=4)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: p["stages"][3].update(llm_layers=[29, 47]), "llm layers add up to 47.*has 48"),
        (lambda p: p["stages"][2].update(llm_layers=[11, 29]), "stage 2: llm_layers.*continue"),
        (lambda p: p["stages"][0].update(vit_recompute=31), "stage 0: vit_recompute=31.*30"),
        (lambda p: p["stages"][1].update(llm_recompute=-1), "stage 1: llm_recompute=-1"),
        (lambda p: p["stages"][1].pop("head"), "plan stage 1: missing field 'head'"),
        (lambda p: p["stages"][1].update(vit_layers=[30]), "plan stage 1 vit_layers"),
        (lambda p: p["stages"][3].update(head=False), "'head' must be on exactly one stage"),
        (
            lambda p: (
                p["stages"][1].update(llm_embed=False) or p["stages"][2].update(llm_embed=True)
            ),
            "llm_embed \\(stage 2\\) must be on the projector's stage \\(1\\)",
        ),
        (
            lambda p: (
                p["stages"][1].update(projector=False, llm_embed=False)
                or p["stages"][0].update(projector=True, llm_embed=True)
            ),
            "projector on stage 0 comes before",
        ),
        (lambda p: p["stages"][2].update(stage=5), "plan stage 2: says 'stage': 5"),
    ],
)
def test_bad_plans_are_named(edit, message: str) -> None:
    plan = copy.deepcopy(PLAN)
    edit(plan)
    with pytest.raises(LayoutError, match=message):
        layout_from_plan(plan, pp_size=4)


def test_projector_may_sit_between_vit_and_llm() -> None:
    plan = copy.deepcopy(PLAN)
    plan["stages"][1].update(llm_layers=[0, 0], projector=False, llm_embed=False, llm_recompute=0)
    plan["stages"][2].update(llm_layers=[0, 29], projector=True, llm_embed=True)
    st = layout_from_plan(plan, pp_size=4)
    assert st[2].projector and st[2].llm_embed and not st[1].projector


def test_projector_after_first_llm_layer_is_rejected() -> None:
    plan = copy.deepcopy(PLAN)
    plan["stages"][1].update(projector=False, llm_embed=False)
    plan["stages"][2].update(projector=True, llm_embed=True)
    with pytest.raises(LayoutError, match="projector on stage 2 comes after the first LLM"):
        layout_from_plan(plan, pp_size=4)


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
        "import sys, megatron_omnibal.megatron.layout; "
        "sys.exit(int('torch' in sys.modules or 'megatron.core' in sys.modules))"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
