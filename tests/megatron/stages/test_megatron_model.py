"""The VLM stage module on real megatron-core pipelines (torchrun, gloo, 4 CPU processes).

Oracle: the PP=1, TP=1 run of the same weights on the same micro-batches. Every other split
(ViT on stage 0 only, ViT across two stages, a stage mixing the ViT tail with the first LLM
layers, recompute, TP=2 x PP=2) must give the same loss per micro-batch and the same gradient for
every parameter, matched by global layer name. One torchrun runs all cases (start-up once).
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
WORKER = ROOT / "tests" / "helpers" / "megatron_workers" / "model_worker.py"
RTOL = 1e-5

SPEC = {
    "vit": {
        "num_layers": 4,
        "hidden_size": 32,
        "ffn_hidden_size": 64,
        "num_attention_heads": 4,
        "image_size": 16,
        "patch_size": 4,
        "class_token": True,  # as InternViT: one more ViT token, dropped before the projector
    },
    "projector": {"type": "pixel_shuffle_mlp", "downsample": 0.5, "hidden_size": 48},
    "llm": {
        "num_layers": 4,
        "hidden_size": 32,
        "ffn_hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "vocab_size": 256,
    },
}
# [vit_num, token_num, image_flags] per sample, per micro-batch (4 image tokens per real tile):
# images, a text-only sample with a dummy tile, a micro-batch with no tile at all, many tiles.
BATCHES = [[[2, 20, 2], [1, 9, 1]], [[1, 12, 0]], [[0, 10, 0], [0, 7, 0]], [[3, 30, 3]]]
CASES = [
    {"name": "pp1", "tp": 1, "pp": 1, "vit": [4], "llm": [4]},
    {"name": "pp2_vit_stage0", "tp": 1, "pp": 2, "vit": [4, 0], "llm": [0, 4]},
    {"name": "pp4_vit_stage0", "tp": 1, "pp": 4, "vit": [4, 0, 0, 0], "llm": [0, 2, 1, 1]},
    {"name": "pp4_vit_two_stages", "tp": 1, "pp": 4, "vit": [2, 2, 0, 0], "llm": [0, 0, 2, 2]},
    {"name": "pp4_mixed", "tp": 1, "pp": 4, "vit": [3, 1, 0, 0], "llm": [0, 1, 2, 1]},
    {
        "name": "pp2_recompute",
        "tp": 1,
        "pp": 2,
        "vit": [3, 1],
        "llm": [0, 4],
        "vit_recompute": [2, 1],
        "llm_recompute": [0, 3],
    },
    {"name": "tp2pp2", "tp": 2, "pp": 2, "vit": [3, 1], "llm": [0, 4]},
    {"name": "pp2_dropout", "tp": 1, "pp": 2, "vit": [3, 1], "llm": [0, 4], "dropout": 0.2},
    {
        "name": "pp2_dropout_recompute",
        "tp": 1,
        "pp": 2,
        "vit": [3, 1],
        "llm": [0, 4],
        "dropout": 0.2,
        "vit_recompute": [3, 1],
        "llm_recompute": [0, 3],
    },
    {"name": "pp2_split", "tp": 1, "pp": 2, "vit": [3, 1], "llm": [0, 4], "split_samples": True},
    # LLM depths that divide by no pipeline size: the ViT across two stages and a stage without
    # LLM layers, one LLM layer on a stage, many on another.
    {"name": "llm5_pp1", "tp": 1, "pp": 1, "vit": [4], "llm": [5], "llm_layers": 5},
    {"name": "llm5_pp2", "tp": 1, "pp": 2, "vit": [2, 2], "llm": [0, 5], "llm_layers": 5},
    {"name": "llm5_pp4", "tp": 1, "pp": 4, "vit": [4, 0, 0, 0], "llm": [0, 1, 3, 1],
     "llm_layers": 5},
    {"name": "llm7_pp1", "tp": 1, "pp": 1, "vit": [4], "llm": [7], "llm_layers": 7},
    {"name": "llm7_pp2", "tp": 1, "pp": 2, "vit": [4, 0], "llm": [1, 6], "llm_layers": 7},
    {"name": "llm7_pp4", "tp": 1, "pp": 4, "vit": [2, 2, 0, 0], "llm": [0, 2, 4, 1],
     "llm_layers": 7},
    {"name": "llm7_pp4_dropout", "tp": 1, "pp": 4, "vit": [2, 2, 0, 0], "llm": [0, 2, 4, 1],
     "llm_layers": 7, "dropout": 0.2},
    {"name": "llm7_pp4_dropout_recompute", "tp": 1, "pp": 4, "vit": [2, 2, 0, 0],
     "llm": [0, 2, 4, 1], "llm_layers": 7, "dropout": 0.2, "vit_recompute": [1, 2, 0, 0],
     "llm_recompute": [0, 1, 4, 1]},
]


def reference(case: dict) -> str:
    """The PP=1 case of the same model."""
    return f"llm{case['llm_layers']}_pp1" if "llm_layers" in case else "pp1"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("vlm")
    cfg = out / "cases.json"
    cfg.write_text(json.dumps({"spec": SPEC, "seed": 1234, "batches": BATCHES, "cases": CASES}))
    code, stdout, stderr = run_ranks(WORKER, 4, [str(cfg), str(out)], timeout=240)
    if code:
        pytest.fail(f"worker failed ({code}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return out


def load(out: Path, name: str) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    losses: list[list[float]] = []
    grads: dict[str, torch.Tensor] = {}
    files = sorted(out.glob(f"{name}.stage*.pt"))
    assert files, f"no results for case {name}"
    for f in files:
        r = torch.load(f)
        losses = r["losses"] or losses
        for k, v in r["grads"].items():
            assert k not in grads, f"{k} on two stages"
            grads[k] = v
    return losses, grads


def assert_same(out: Path, name: str, ref: str = "pp1") -> None:
    ref_losses, ref_grads = load(out, ref)
    losses, grads = load(out, name)
    assert len(losses) == len(BATCHES)
    for mb, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert a[1] == b[1], f"micro-batch {mb}: {a[1]} loss tokens vs {b[1]}"
        assert a[0] == pytest.approx(b[0], rel=RTOL), f"micro-batch {mb} loss"
    assert set(grads) == set(ref_grads)
    for k, g in ref_grads.items():
        assert g.abs().max() > 0, f"{k}: zero gradient in the reference"
        err = (grads[k] - g).abs().max() / g.abs().max()
        assert err <= RTOL, f"{name}: gradient of {k} differs by {float(err):.2e} (relative)"


@pytest.mark.parametrize(
    "name", ["pp2_vit_stage0", "pp4_vit_stage0", "pp4_vit_two_stages", "pp4_mixed"]
)
def test_pipeline_split_matches_pp1(results: Path, name: str) -> None:
    assert_same(results, name)


@pytest.mark.parametrize("name", ["llm5_pp2", "llm5_pp4", "llm7_pp2", "llm7_pp4"])
def test_uneven_llm_depths_match_pp1(results: Path, name: str) -> None:
    """5 and 7 LLM layers over 2 and 4 stages (0, 1 or many per stage) train as PP=1 does."""
    assert_same(results, name, ref=name.split("_")[0] + "_pp1")


def test_recompute_matches_no_recompute(results: Path) -> None:
    assert_same(results, "pp2_recompute")


def test_uneven_recompute_with_dropout_replays_the_same_masks(results: Path) -> None:
    """7 LLM layers split 0 + 2 + 4 + 1: each stage's per-layer RNG streams replay in the
    recompute (first k layers of each stage, all of stage 2's)."""
    assert_same(results, "llm7_pp4_dropout_recompute", ref="llm7_pp4_dropout")
    drop, _ = load(results, "llm7_pp4_dropout")
    plain, _ = load(results, "llm7_pp4")
    assert any(abs(a[0] - b[0]) > 1e-3 * abs(b[0]) for a, b in zip(drop, plain, strict=True))


def test_recompute_with_dropout_replays_the_same_masks(results: Path) -> None:
    assert_same(results, "pp2_dropout_recompute", ref="pp2_dropout")
    # ... and dropout really was active (otherwise the test above proves nothing).
    drop, _ = load(results, "pp2_dropout")
    plain, _ = load(results, "pp1")
    assert any(abs(a[0] - b[0]) > 1e-3 * abs(b[0]) for a, b in zip(drop, plain, strict=True))


def test_tensor_parallel_2_x_pipeline_2_matches(results: Path) -> None:
    assert_same(results, "tp2pp2")


def test_packing_does_not_leak_between_samples(results: Path) -> None:
    """Packed micro-batch loss == sum of its samples run alone; gradients identical."""
    packed, packed_grads = load(results, "pp1")
    split, split_grads = load(results, "pp2_split")
    i = 0
    for mb, batch in enumerate(BATCHES):
        alone = split[i : i + len(batch)]
        i += len(batch)
        assert packed[mb][0] == pytest.approx(sum(x[0] for x in alone), rel=RTOL)
        assert packed[mb][1] == sum(x[1] for x in alone)
    for k, g in packed_grads.items():
        assert (split_grads[k] - g).abs().max() <= RTOL * g.abs().max(), k


def test_no_image_micro_batch_completes(results: Path) -> None:
    """Micro-batch 2 has no tile at all; it ran through every split (no hang) with a loss."""
    for case in CASES:
        losses, _ = load(results, case["name"])
        n_samples = sum(len(b) for b in BATCHES)
        assert len(losses) == (n_samples if case.get("split_samples") else len(BATCHES))
        assert all(x[0] > 0 and x[1] > 0 for x in losses)


def test_checkpoint_keys_and_layer_numbers_are_global(results: Path) -> None:
    """Every split's stages together hold exactly the PP=1 checkpoint shards (key, global
    offset, global shape), each once, and their layers carry the global (1-based) numbers of
    their layout range: a checkpoint of one plan loads into another plan's split."""
    qkv = [k for k in torch.load(results / "pp1.stage0.pt")["checkpoint_keys"]
           if k[0] == "vit.layers.self_attention.linear_qkv.weight"]  # fmt: skip
    assert [k[1][0] for k in qkv] == [0, 1, 2, 3] and qkv[0][2][0] == 4  # layer axis
    for case in CASES:
        ref = torch.load(results / f"{reference(case)}.stage0.pt")["checkpoint_keys"]
        keys: list[str] = []
        for f in sorted(results.glob(f"{case['name']}.stage*.pt")):
            r = torch.load(f)
            keys += r["checkpoint_keys"]
            stage = int(f.name.rsplit("stage", 1)[1].split(".")[0])
            for tower in ("vit", "llm"):
                first = sum(case[tower][:stage])
                want = list(range(first + 1, first + case[tower][stage] + 1))
                assert r["layer_numbers"].get(tower, []) == want, (case["name"], stage, tower)
        assert sorted(keys) == ref, case["name"]


def test_every_stage_carries_megatron_process_groups(results: Path) -> None:
    """megatron.training's train() reads model.pg_collection (mp, pp, dp_cp): every stage of
    every split holds parallel_state's groups itself, with no wrapper setting them."""
    for case in CASES:
        files = sorted(results.glob(f"{case['name']}.stage*.pt"))
        assert len(files) == case["pp"]
        for f in files:
            assert torch.load(f)["process_groups"] == [True] * 4, f.name
