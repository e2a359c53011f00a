"""LoRA adapters on the VLM stages, on real megatron-core pipelines (4 gloo CPU ranks, one
launch for every case).

Oracles: the merged model (W + alpha/r B A, no adapters) gives the adapter model's losses; the
PP=1, TP=1 LoRA run gives every other layout's losses and adapter gradients (TP=2 with sequence
parallelism and padded ViT heads, uneven PP=4 with the ViT over two stages, recompute, adapter
dropout replayed by recompute; the ViT runs TP without sequence parallelism, so both paths of
each kind of layer are taken); the merged weights gathered at TP=2 are those of TP=1 bit for
bit; only adapters require a gradient; every layout starts from the same adapters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "megatron_workers" / "lora_worker.py"
RTOL = 1e-5

SPEC = {  # 3 ViT heads: TP=2 pads a dummy head; a gated LLM MLP with GQA
    "vit": {"num_layers": 4, "hidden_size": 48, "ffn_hidden_size": 64, "num_attention_heads": 3,
            "image_size": 16, "patch_size": 4, "class_token": True},
    "projector": {"type": "pixel_shuffle_mlp", "downsample": 0.5, "hidden_size": 48},
    "llm": {"num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
            "num_query_groups": 2, "vocab_size": 256},
}  # fmt: skip
BATCHES = [[[2, 20, 2], [1, 9, 1]], [[1, 12, 0]], [[3, 30, 3]]]
LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0,
        "targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "vit.*"]}  # fmt: skip
LLM_ONLY = {"targets": ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]}
DROPOUT = {"dropout": 0.3}
CASES = [
    {"name": "merged", "tp": 1, "pp": 1, "vit": [4], "llm": [4], "lora": False},
    {"name": "pp1", "tp": 1, "pp": 1, "vit": [4], "llm": [4]},
    {"name": "tp2pp2_sp_recompute", "tp": 2, "pp": 2, "vit": [3, 1], "llm": [0, 4],
     "sequence_parallel": True, "vit_recompute": [2, 1], "llm_recompute": [0, 3]},
    {"name": "pp4_uneven", "tp": 1, "pp": 4, "vit": [2, 2, 0, 0], "llm": [0, 0, 3, 1],
     "llm_recompute": [0, 0, 2, 1]},
    # LLM adapters only: stage 0 holds frozen ViT layers alone; PP=1 recomputes every layer
    # (its adapters get gradients only if the frozen embedding's output requires one)
    {"name": "llm_only_pp1", "tp": 1, "pp": 1, "vit": [4], "llm": [4], "lora": LLM_ONLY,
     "llm_recompute": [4], "vit_recompute": [4]},
    {"name": "llm_only_pp2", "tp": 1, "pp": 2, "vit": [2, 2], "llm": [0, 4], "lora": LLM_ONLY},
    {"name": "dropout", "tp": 1, "pp": 2, "vit": [3, 1], "llm": [0, 4], "lora": DROPOUT},
    {"name": "dropout_recompute", "tp": 1, "pp": 2, "vit": [3, 1], "llm": [0, 4],
     "lora": DROPOUT, "vit_recompute": [3, 1], "llm_recompute": [0, 4]},
]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora")
    cfg = out / "cases.json"
    cfg.write_text(json.dumps({"spec": SPEC, "seed": 99, "batches": BATCHES, "lora": LORA,
                               "cases": CASES}))  # fmt: skip
    code, stdout, stderr = run_ranks(WORKER, 4, [str(cfg), str(out)], timeout=300)
    if code:
        pytest.fail(f"worker failed ({code}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return out


def load(out: Path, name: str) -> dict:
    merged: dict = {"losses": [], "grads": {}, "trainable": [], "merged": {}, "built": {}}
    files = sorted(out.glob(f"{name}.stage*.pt"))
    assert files, f"no results for case {name}"
    for f in files:
        r = torch.load(f)
        merged["losses"] = r["losses"] or merged["losses"]
        for key in ("grads", "merged", "built"):
            assert not set(r[key]) & set(merged[key]), "a tensor on two stages"
            merged[key].update(r[key])
        merged["trainable"] += r["trainable"]
    return merged


def assert_same(out: Path, name: str, ref: str) -> None:
    want, got = load(out, ref), load(out, name)
    assert len(got["losses"]) == len(BATCHES)
    for mb, (a, b) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        assert a[1] == b[1]
        assert a[0] == pytest.approx(b[0], rel=RTOL), f"{name}: micro-batch {mb} loss"
    assert set(got["grads"]) == set(want["grads"])
    for k, g in want["grads"].items():
        assert g.abs().max() > 0, f"{ref}: {k} has no gradient"
        err = float((got["grads"][k] - g).abs().max() / g.abs().max())
        assert err <= RTOL, f"{name}: gradient of {k} differs by {err:.2e}"


def test_adapter_forward_equals_merged_forward(results: Path) -> None:
    lora, plain = load(results, "pp1"), load(results, "merged")
    for a, b in zip(lora["losses"], plain["losses"], strict=True):
        assert a[0] == pytest.approx(b[0], rel=RTOL)
    base = load(results, "llm_only_pp1")
    assert any(abs(a[0] - b[0]) > 1e-3 * abs(b[0])  # the adapters do change the function
               for a, b in zip(lora["losses"], base["losses"], strict=True))  # fmt: skip


def test_only_adapters_require_gradients(results: Path) -> None:
    got = load(results, "pp1")
    assert got["trainable"] and all(n.endswith((".lora_a", ".lora_b")) for n in got["trainable"])
    assert sum(n.startswith("vit.") for n in got["trainable"]) == 4 * 4 * 2
    assert sum(n.startswith("llm.") for n in got["trainable"]) == 4 * 4 * 2
    llm_only = load(results, "llm_only_pp2")["trainable"]
    assert llm_only and all(n.startswith("llm.") for n in llm_only)


@pytest.mark.parametrize("name", ["tp2pp2_sp_recompute", "pp4_uneven"])
def test_layouts_match_pp1(results: Path, name: str) -> None:
    assert_same(results, name, "pp1")


def test_frozen_first_stages_still_pass_gradients(results: Path) -> None:
    assert_same(results, "llm_only_pp2", "llm_only_pp1")


def test_recompute_replays_adapter_dropout(results: Path) -> None:
    assert_same(results, "dropout_recompute", "dropout")
    drop, plain = load(results, "dropout"), load(results, "pp1")
    assert any(abs(a[0] - b[0]) > 1e-3 * abs(b[0])
               for a, b in zip(drop["losses"], plain["losses"], strict=True))  # fmt: skip


def test_tp2_merge_equals_tp1_merge_bit_for_bit(results: Path) -> None:
    tp1, tp2 = load(results, "pp1")["merged"], load(results, "tp2pp2_sp_recompute")["merged"]
    assert set(tp1) == set(tp2) and len(tp1) == 32
    for name, w in tp1.items():
        assert torch.equal(tp2[name], w), name


def test_adapters_start_alike_at_every_layout(results: Path) -> None:
    """B zero, A drawn from the layer's name: the same whole adapters at TP=1, TP=2 (padded
    ViT heads) and PP=4."""
    ref = load(results, "pp1")["built"]
    assert len(ref) == 64
    for name, t in ref.items():
        if name.endswith(".lora_b"):
            assert not t.any(), name
        else:
            assert t.abs().max() > 0 and t.abs().max() <= t.shape[1] ** -0.5, name
    for case in ("tp2pp2_sp_recompute", "pp4_uneven"):
        got = load(results, case)["built"]
        assert set(got) == set(ref)
        for name, t in ref.items():
            assert torch.equal(got[name], t), (case, name)
