"""Adapter-only LoRA checkpoints through megatron.training: saved at PP=2 x vpp=2 (interleaved
1F1B), resumed at PP=2 without virtual stages, the base from --pretrained-checkpoint.

Oracle: the uninterrupted PP=1 LoRA run from the same base. The PP=2 x vpp=2 run trains with its
losses; its torch_dist save at step 2 holds the adapters alone (their optimizer state and the
iteration with them), and the resumed run starts from its parameters (the base's weights, the
saved adapters) and continues with PP=1's losses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.megatron.training.test_megatron_vpp import ITERS, MICRO, _base_plan, _flags, _plan

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from run_records import WORKER, head_micro, params, recorded_run  # noqa: E402

SAVED = 2
LORA = ("--omnibal-lora-rank", "4", "--omnibal-lora-alpha", "16", "--omnibal-lora-dropout",
        "0", "--omnibal-lora-targets", "linear_qkv,linear_fc2,vit.*.linear_fc1", "--lr",
        "1e-2")  # fmt: skip


@pytest.fixture(scope="module")
def runs(lengths_file: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("lora_resume")
    base = _base_plan(lengths_file, tmp)
    plans = {name: _plan(base, name, tmp / f"{name}.json") for name in ("pp1", "pp2v2", "pp2")}
    pretrained, ckpt = tmp / "pretrained", tmp / "ckpt"
    start = ("--pretrained-checkpoint", str(pretrained), *LORA)
    at_saved = {"RECORD_PARAMS_AT_STEP": str(SAVED)}

    def run(name: str, nproc: int, plan: str, *flags: str, env=None) -> SimpleNamespace:
        return recorded_run(WORKER, nproc, tmp / name, _flags(plans[plan], *flags), env, 400)

    out = {"base": run("base", 1, "pp1", "--save", str(pretrained), "--train-iters", "1",
                       "--save-interval", "1",
                       env={"OMNIBAL_TEST_WEIGHTS": "11"})}  # fmt: skip
    out["pp1"] = run("pp1", 1, "pp1", *start)
    out["pp2v2"] = run("pp2v2", 2, "pp2v2", *start, "--save", str(ckpt), "--save-interval",
                       str(SAVED), env=at_saved)  # fmt: skip
    out["resumed"] = run("resumed", 2, "pp2", *start, "--load", str(ckpt), "--ckpt-step",
                         str(SAVED), env=at_saved)  # fmt: skip
    out["ckpt"] = ckpt
    return out


def _losses(run: SimpleNamespace) -> list[float]:
    return [m["loss"] for m in head_micro(run.records)]


def test_lora_at_pp2_vpp2_trains_as_pp1(runs: dict) -> None:
    ref = _losses(runs["pp1"])
    assert len(ref) == ITERS * MICRO
    assert _losses(runs["pp2v2"]) == pytest.approx(ref, rel=1e-5)


def test_adapter_only_save_holds_the_adapters_alone(runs: dict) -> None:
    from megatron.core.dist_checkpointing import load_common_state_dict
    from torch.distributed.checkpoint import FileSystemReader

    it = runs["ckpt"] / f"iter_{SAVED:07d}"
    keys = set(FileSystemReader(str(it)).read_metadata().state_dict_metadata)
    state = {k for k in keys if not k.startswith(("rng_state/", "rerun_state", "common_state/"))}
    # the ViT's fc1 and the LLM's qkv and fc2 (each tower's layers stacked in one tensor)
    adapters = {f"{tower}.layers.{layer}.lora_{m}" for tower, layer in (
        ("vit", "mlp.linear_fc1"), ("llm", "self_attention.linear_qkv"),
        ("llm", "mlp.linear_fc2")) for m in "ab"}  # fmt: skip
    moments = {f"optimizer.state.{m}.{a}" for m in ("exp_avg", "exp_avg_sq") for a in adapters}
    assert state == adapters | moments
    args = load_common_state_dict(str(it))["args"]
    assert json.loads(args.omnibal_lora)["rank"] == 4 and args.omnibal_lora_save == "adapters"


def test_resumed_at_another_layout_continues_as_pp1(runs: dict) -> None:
    saved, _ = params(runs["pp2v2"].out)
    loaded, stage = params(runs["resumed"].out)
    assert sorted(loaded) == sorted(saved)
    adapters = [n for n in saved if n.endswith((".lora_a", ".lora_b"))]
    assert adapters and any(saved[n].abs().max() > 0 for n in adapters if n.endswith("lora_b"))
    for name, value in saved.items():
        assert torch.equal(loaded[name], value), name
    want = _losses(runs["pp1"])[MICRO * SAVED :]
    assert _losses(runs["resumed"]) == pytest.approx(want, rel=1e-5)
