"""LoRA through `megatron_omnibal.pretrain_vlm` and megatron.training (local gloo ranks): the
tiny model with adapters on the LLM's four linear layers and the projector trained in full.

Oracle: the PP=1 run of the same weights (set from each parameter's model-wide name). The PP=2
run splits the ViT over both stages (stage 0 holds frozen ViT layers only: no parameter to
train there), recomputes layers on both, and gives PP=1's losses and every gradient each
optimizer step applies; the optimizer holds the adapters and the projector, nothing else.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from run_records import (  # noqa: E402
    WORKER,
    assert_same_grads,
    head_micro,
    recorded_run,
    step_grads,
)

ITERS, MICRO = 3, 2
LAYOUTS = {"pp1": ("4", "4", "0", "0"), "pp2": ("2,2", "0,4", "1,1", "0,2")}


def lora_flags(lengths_file: Path, name: str, *extra: str) -> list[str]:
    vit, llm, vit_rc, llm_rc = LAYOUTS[name]
    return [
        "--omnibal", "--omnibal-model", "tiny", "--omnibal-lengths", str(lengths_file),
        "--omnibal-vit-budget", "16", "--omnibal-token-budget", "160",
        "--omnibal-text-scale", "8", "--micro-batch-size", "1", "--global-batch-size",
        str(MICRO), "--lr", "1e-2", "--min-lr", "1e-3", "--lr-decay-style", "cosine",
        "--clip-grad", "1.0", "--transformer-impl", "local", "--seed", "5",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", str(ITERS),
        "--log-interval", "1", "--pipeline-model-parallel-size", str(len(vit.split(","))),
        "--omnibal-vit-pp-layers", vit, "--omnibal-llm-pp-layers", llm,
        "--omnibal-vit-recompute", vit_rc, "--omnibal-llm-recompute", llm_rc,
        "--omnibal-lora-rank", "4", "--omnibal-lora-alpha", "8", "--omnibal-lora-dropout", "0",
        "--omnibal-lora-train", "projector", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(
    lengths_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, SimpleNamespace]:
    tmp = tmp_path_factory.mktemp("lora_train")
    env = {"OMNIBAL_TEST_WEIGHTS": "3", "OMNIBAL_TEST_GRADS": "1"}
    return {
        "pp1": recorded_run(WORKER, 1, tmp / "pp1", lora_flags(lengths_file, "pp1"), env),
        "pp2": recorded_run(WORKER, 2, tmp / "pp2", lora_flags(lengths_file, "pp2"), env),
    }


def test_pp2_lora_trains_as_pp1(runs: dict) -> None:
    pp1, pp2 = head_micro(runs["pp1"].records), head_micro(runs["pp2"].records)
    assert len(pp1) == len(pp2) == MICRO * ITERS
    assert [m["indices"] for m in pp2] == [m["indices"] for m in pp1]
    assert [m["loss"] for m in pp2] == pytest.approx([m["loss"] for m in pp1], rel=1e-5)
    assert pp1[-1]["loss"] != pytest.approx(pp1[0]["loss"], rel=1e-3)  # it trained
    ref, got = step_grads(runs["pp1"].out), step_grads(runs["pp2"].out)
    assert len(ref) == len(got) == ITERS
    assert_same_grads(got, ref)


def test_optimizer_holds_only_adapters_and_the_unfrozen_projector(runs: dict) -> None:
    for name, run in runs.items():
        held = sorted(n for r in run.records.values() for n in (r["optimizer_params"] or []))
        adapters = [n for n in held if n.endswith((".lora_a", ".lora_b"))]
        others = [n for n in held if n not in adapters]
        assert len(adapters) == 4 * 4 * 2, name
        assert all(n.startswith("llm.layers.") for n in adapters)
        assert others and all(n.startswith("projector.") for n in others), (name, others)
        grads = step_grads(run.out)[0]
        assert set(grads) == set(held)
    stage0 = [r for r in runs["pp2"].records.values() if r["pp_rank"] == 0]
    assert not stage0[0]["optimizer_params"]  # frozen ViT layers only
