"""Qwen3-VL's stages (tests/helpers/qwen3_vl.py's tiny model) on real megatron-core schedules.

Oracles: transformers' `Qwen3VLForConditionalGeneration` with the same weights (mapped by
models/families/qwen3_vl/weights.py), each sample with its own 3-D positions (a video too: two
temporal patches with timestamp text between their tokens, one grid per temporal patch in the
micro-batch, transformers' video inputs on its side): logits within 1e-4 at PP=1,
at PP=3 with DeepStack crossing stages and at TP=2 with sequence parallelism; the PP=1 loss and
every gradient within 1e-4. Then every other layout against PP=1 (losses and every gradient,
1e-5): the tapped ViT layers on two stages and LLM layer 0 a stage later (recompute on), LLM
layers 0, 1, 2 on three different stages, six virtual stages over three ranks (interleaved
1F1B, every tap and block crossing ranks), TP=2 with sequence parallelism, and TP=2 x PP=2 with
sequence parallelism (the blocks cross stages split over the TP ranks). Two launches (3 and 4
ranks), forked from the rank server.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_ranks  # noqa: E402

from megatron_omnibal.data.lengths import from_arrays  # noqa: E402
from megatron_omnibal.megatron.stream.batch import synthetic_sample  # noqa: E402
from megatron_omnibal.models.families.qwen3_vl.weights import patch_shapes  # noqa: E402
from megatron_omnibal.models.hf_weights import spec_shapes  # noqa: E402
from megatron_omnibal.models.spec import ModelSpec  # noqa: E402
from tests.helpers import qwen3_vl  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "megatron_workers" / "qwen3_vl_worker.py"
SEED = 5
# [merge units, tokens, merge units] per sample, per micro-batch: a 4x6-patch and a 2x4-patch
# image packed with text, a text-only micro-batch, a 6x6-patch image.
BATCHES = [[[6, 20, 6], [2, 12, 2]], [[0, 10, 0]], [[9, 24, 9]]]
THREE_RANKS = [
    {"name": "pp1", "tp": 1, "pp": 1, "vit": [4], "llm": [4]},
    # taps 0 | 2, 3 made on stages 0 | 1; LLM layer 0 on stage 1, layers 1 and 2 on stage 2
    {"name": "pp3_split", "tp": 1, "pp": 3, "vit": [2, 2, 0], "llm": [0, 1, 3],
     "vit_recompute": [1, 2, 0], "llm_recompute": [0, 1, 2]},
    # LLM layers 0, 1, 2 on three stages
    {"name": "pp3_llm", "tp": 1, "pp": 3, "vit": [4, 0, 0], "llm": [1, 1, 2]},
    {"name": "pp3_vpp2", "tp": 1, "pp": 3, "vpp": 2, "vit": [2, 2, 0, 0, 0, 0],
     "llm": [0, 0, 1, 1, 1, 1]},
]  # fmt: skip
FOUR_RANKS = [
    {"name": "tp1", "tp": 1, "pp": 1, "vit": [4], "llm": [4]},
    {"name": "tp2_sp", "tp": 2, "pp": 1, "vit": [4], "llm": [4], "sequence_parallel": True},
    # the blocks of LLM layers 1 and 2 cross to stage 1 split over the TP ranks
    {"name": "tp2pp2_sp", "tp": 2, "pp": 2, "vit": [4, 0], "llm": [1, 3],
     "sequence_parallel": True},
]  # fmt: skip


def samples(spec: ModelSpec) -> list[list]:
    records = [r for mb in BATCHES for r in mb]
    lengths = from_arrays(*([r[k] for r in records] for k in range(3)))
    out, i = [], 0
    for mb in BATCHES:
        out.append([synthetic_sample(i + k, lengths, spec, SEED) for k in range(len(mb))])
        i += len(mb)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("qwen3_vl")
    spec = ModelSpec.from_dict(qwen3_vl.SPEC)
    model = qwen3_vl.hf_model(SEED)
    torch.save(qwen3_vl.canonical_from_hf(spec, model.state_dict()), root / "weights.pt")
    batches = samples(spec)
    video = qwen3_vl.video_sample(spec, SEED)
    torch.save([dataclasses.asdict(video)], root / "video.pt")
    logits = qwen3_vl.reference_logits(model, [s for mb in batches for s in mb], [video])
    losses, grads = qwen3_vl.reference_loss_and_grads(model, batches)
    for ranks, cases in ((3, THREE_RANKS), (4, FOUR_RANKS)):
        cfg = root / f"cases{ranks}.json"
        cfg.write_text(json.dumps({"spec": qwen3_vl.SPEC, "weights": str(root / "weights.pt"),
                                   "seed": SEED, "batches": BATCHES, "cases": cases,
                                   "extra_probe": str(root / "video.pt")}))  # fmt: skip
        code, stdout, stderr = run_ranks(WORKER, ranks, [str(cfg), str(root)], timeout=600)
        if code:
            pytest.fail(f"worker failed ({code}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return {"root": root, "logits": logits, "losses": losses,
            "grads": qwen3_vl.canonical_from_hf(spec, grads), "model": model}  # fmt: skip


def load(root: Path, name: str) -> dict:
    merged: dict = {"losses": [], "grads": {}, "forward": {}, "checkpoint_keys": []}
    files = sorted(root.glob(f"{name}.stage*.pt"))
    assert files, f"no results for {name}"
    for f in files:
        r = torch.load(f)
        merged["losses"] = r["losses"] or merged["losses"]
        merged["checkpoint_keys"] += r["checkpoint_keys"]
        for key in ("grads", "forward"):
            for k, v in r[key].items():
                assert k not in merged[key], f"{name}: {k} on two stages"
                merged[key][k] = v
    return merged


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", ["pp1", "pp3_split", "pp3_llm", "tp1", "tp2_sp", "tp2pp2_sp"])
def test_logits_equal_transformers(runs: dict, name: str) -> None:
    got = load(runs["root"], name)["forward"]
    assert relative(got["logits"], runs["logits"]) <= 1e-4


def test_pp1_loss_and_every_gradient_equal_transformers(runs: dict) -> None:
    got = load(runs["root"], "pp1")
    assert [x[0] for x in got["losses"]] == pytest.approx(runs["losses"], rel=1e-5)
    assert set(got["grads"]) == set(runs["grads"])
    # the weight rules' shapes are the stages' parameters' (the converter checks with them)
    spec = ModelSpec.from_dict(qwen3_vl.SPEC)
    shapes = spec_shapes(spec, patch_shapes(spec.vit))
    assert {k: tuple(g.shape) for k, g in got["grads"].items()} == shapes
    for k, g in runs["grads"].items():
        assert relative(got["grads"][k], g) <= 1e-4, k


@pytest.mark.parametrize(("name", "ref"), [("pp3_split", "pp1"), ("pp3_llm", "pp1"),
                                           ("pp3_vpp2", "pp1"), ("tp2_sp", "tp1"),
                                           ("tp2pp2_sp", "tp1")])  # fmt: skip
def test_layout_matches_pp1(runs: dict, name: str, ref: str) -> None:
    want, got = load(runs["root"], ref), load(runs["root"], name)
    assert len(got["losses"]) == len(BATCHES)
    for a, b in zip(got["losses"], want["losses"], strict=True):
        assert a[1] == b[1] and a[0] == pytest.approx(b[0], rel=1e-5)
    assert set(got["grads"]) == set(want["grads"])
    for k, g in want["grads"].items():
        assert g.abs().max() > 0, f"{k}: zero gradient in the reference"
        assert relative(got["grads"][k], g) <= 1e-5, f"{name}: {k}"


@pytest.mark.parametrize(("name", "ref"), [("pp3_split", "pp1"), ("pp3_vpp2", "pp1"),
                                           ("tp2pp2_sp", "tp1")])  # fmt: skip
def test_checkpoint_shards_match_pp1(runs: dict, name: str, ref: str) -> None:
    """Every shard (key, global layer offset, global shape) of a split is PP=1's, the DeepStack
    mergers' TP-split MLPs included, so a checkpoint of one layout loads at another."""
    want, got = load(runs["root"], ref), load(runs["root"], name)
    assert sorted(got["checkpoint_keys"]) == sorted(want["checkpoint_keys"])
    fc1 = "deepstack_mergers.0.mlp.linear_fc1.weight"
    assert [k[2] for k in got["checkpoint_keys"] if k[0] == fc1] == [(128, 128)]
