"""A mixture-of-experts VLM on real megatron-core pipelines with expert parallelism (4 gloo
ranks on CPU, one launch for every layout).

Oracle: the EP=1, PP=1 run of the same weights (DP=4, each rank one data shard). EP=2 (DP=4,
experts split over pairs of ranks, all-to-all dispatch), an uneven PP=2 x EP=2 with the ViT
over both stages (DP=2, two shards a rank) and TP=2 (sequence parallel) x EP=2 (experts split
over TP too) must give the same loss for every micro-batch and the
same gradient for every parameter, each summed as DDP sums it (dense ones over DP, experts over
expert-DP) and experts gathered over EP by their global index. The routers' choices are
recounted in Python from their inputs and weights: the step's tokens per expert against
ExpertLoad's (what the training log shows), and the switch load-balancing loss against
megatron-core's tracker.
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
WORKER = ROOT / "tests" / "helpers" / "megatron_workers" / "moe_worker.py"
RTOL = 1e-5
EXPERTS, TOP_K, AUX = 4, 2, 0.01

SPEC = {
    "vit": {
        "num_layers": 2,
        "hidden_size": 32,
        "ffn_hidden_size": 64,
        "num_attention_heads": 4,
        "image_size": 16,
        "patch_size": 4,
        "class_token": False,  # with these weights every expert of every layer gets tokens
    },
    "projector": {"type": "pixel_shuffle_mlp", "downsample": 0.5, "hidden_size": 48},
    "llm": {
        "num_layers": 3,
        "hidden_size": 32,
        "ffn_hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "vocab_size": 256,
        "num_experts": EXPERTS,
        "moe_top_k": TOP_K,
        "moe_ffn_hidden_size": 24,
        "moe_aux_loss_coeff": AUX,
    },
}
# Four data shards of one micro-batch each ([vit_num, token_num, image_flags] per sample).
# Even token counts: under sequence parallelism (TP=2) no pad token joins the routing.
SHARDS = [
    [[[1, 12, 1], [0, 10, 0]]],
    [[[2, 16, 2]]],
    [[[1, 10, 1], [0, 6, 0]]],
    [[[1, 14, 1]]],
]
CASES = [
    {"name": "ep1", "tp": 1, "pp": 1, "ep": 1, "vit": [2], "llm": [3]},
    {"name": "ep2", "tp": 1, "pp": 1, "ep": 2, "vit": [2], "llm": [3]},
    {"name": "pp2_ep2", "tp": 1, "pp": 2, "ep": 2, "vit": [1, 1], "llm": [0, 3]},
    {"name": "tp2_ep2", "tp": 2, "pp": 1, "ep": 2, "vit": [2], "llm": [3], "sp": True},
    {"name": "ep2_no_aux", "tp": 1, "pp": 1, "ep": 2, "vit": [2], "llm": [3], "aux_coeff": 0.0},
]
LAYOUTS = CASES[:4]
RECOUNTED = CASES[:3]  # the routers' inputs are saved whole without sequence parallelism


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("moe")
    cfg = out / "cases.json"
    cfg.write_text(json.dumps({"spec": SPEC, "seed": 7, "shards": SHARDS, "cases": CASES}))
    code, stdout, stderr = run_ranks(WORKER, 4, [str(cfg), str(out)], timeout=240)
    if code:
        pytest.fail(f"worker failed ({code}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return out


def load(out: Path, name: str) -> dict:
    """One case's results merged over its ranks."""
    merged: dict = {"grads": {}, "losses": {}, "aux": [], "routers": {}, "load": {}, "w": {},
                    "keys": set()}  # fmt: skip
    files = sorted(out.glob(f"{name}.rank*.pt"))
    assert files, f"no results for case {name}"
    for f in files:
        r = torch.load(f, weights_only=False)
        for k, v in r["grads"].items():
            assert k not in merged["grads"] or torch.equal(merged["grads"][k], v), k
            merged["grads"][k] = v
        merged["losses"].update(r["losses"])
        if "load_balancing_loss" in r["aux"]:
            merged["aux"].append(r["aux"]["load_balancing_loss"])
        for k, xs in r["routers"].items():
            merged["routers"].setdefault(k, []).extend(xs)
        tokens = torch.from_numpy(r["expert_tokens"])  # the step's, the same on every rank
        assert not merged["load"] or torch.equal(merged["load"]["all"], tokens)
        merged["load"]["all"] = tokens
        merged["w"].update(r["router_weights"])
        merged["keys"].update(r["checkpoint_keys"])
    return merged


def test_expert_parallel_layouts_match_ep1(results: Path) -> None:
    ref = load(results, "ep1")
    assert sorted(ref["losses"]) == [0, 1, 2, 3]
    experts = [k for k in ref["grads"] if ".mlp.experts.local_experts." in k]
    assert len(experts) == 3 * EXPERTS * 2  # every expert's fc1 and fc2 in every layer
    for case in LAYOUTS[1:]:
        got = load(results, case["name"])
        assert got["losses"].keys() == ref["losses"].keys()
        for shard, losses in ref["losses"].items():
            torch.testing.assert_close(
                torch.tensor(got["losses"][shard]), torch.tensor(losses), rtol=RTOL, atol=1e-5
            )
        assert got["grads"].keys() == ref["grads"].keys(), case["name"]
        # The torch_dist shards: every expert under one key, at its global offset, whatever
        # rank holds it (TP splits tensors further: the same keys and global shapes).
        if case["tp"] == 1:
            assert got["keys"] == ref["keys"], case["name"]
        assert {(k, shape) for k, _, shape in got["keys"]} == {
            (k, shape) for k, _, shape in ref["keys"]
        }, case["name"]
        for k, g in ref["grads"].items():
            assert g.abs().max() > 0 or "bias" in k, f"{k}: no gradient in the reference"
            scale = float(g.abs().max()) or 1.0
            torch.testing.assert_close(
                got["grads"][k], g, rtol=RTOL, atol=RTOL * scale, msg=f"{case['name']} {k}"
            )


def routed(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax scores over all experts [T, E], top-k choice as a 0/1 map [T, E]) by hand."""
    scores = torch.softmax(x.reshape(-1, x.shape[-1]).double() @ weight.double().T, dim=-1)
    chosen = torch.zeros_like(scores)
    chosen.scatter_(1, scores.topk(TOP_K, dim=-1).indices, 1.0)
    return scores, chosen


def test_expert_load_and_aux_loss_recounted_from_the_routers(results: Path) -> None:
    for case in RECOUNTED:
        got = load(results, case["name"])
        assert sorted(got["routers"]) == [f"llm.layers.{i}" for i in range(3)]
        aux = torch.stack(got["aux"]).sum(0) if got["aux"] else None
        assert aux is not None and aux.shape[0] >= 3, "the aux loss was not recorded"
        for i in range(3):
            key = f"llm.layers.{i}"
            weight = got["w"][key]
            tokens, loss = torch.zeros(EXPERTS, dtype=torch.float64), 0.0
            for x in got["routers"][key]:
                scores, chosen = routed(x, weight)
                tokens += chosen.sum(0)
                t = scores.shape[0]
                f = chosen.sum(0) / (t * TOP_K)
                loss += float(EXPERTS * (f * scores.mean(0)).sum())
            assert tokens.sum() == TOP_K * sum(x.shape[0] for x in got["routers"][key])
            torch.testing.assert_close(got["load"]["all"][i], tokens, rtol=0, atol=0)
            assert float(aux[i]) == pytest.approx(loss, rel=1e-5), (case["name"], i)


def test_aux_loss_gradient_reaches_the_routers(results: Path) -> None:
    """With the load-balancing loss on, the last MoE layer's router gets, on top of the same
    gradient as without it, the gradient of coeff x (the loss recomputed by hand) per
    micro-batch, scaled by its token count as megatron-core scales it under per-token loss.
    (Earlier routers' losses also reach the layers below them: only the last is exact by hand.)
    What lies after the last router (its experts, the head) is unchanged."""
    with_aux, without = load(results, "ep2"), load(results, "ep2_no_aux")
    assert not without["aux"] or all(float(a.abs().sum()) == 0 for a in without["aux"])
    downstream = ("llm.layers.2.mlp.experts.", "output_layer", "llm.final")
    after = [k for k in without["grads"] if k.startswith(downstream)]
    assert after
    for k in after:
        torch.testing.assert_close(with_aux["grads"][k], without["grads"][k], msg=k)
    key = "llm.layers.2"
    weight = with_aux["w"][key].double().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for x in with_aux["routers"][key]:
        scores, chosen = routed(x, weight)
        t = scores.shape[0]
        f = chosen.sum(0) / (t * TOP_K)
        total = total + AUX * t * EXPERTS * (f * scores.mean(0)).sum()
    (expected,) = torch.autograd.grad(total, weight)
    name = f"{key}.mlp.router.weight"
    extra = with_aux["grads"][name] - without["grads"][name]
    assert expected.abs().max() > 1e-6
    torch.testing.assert_close(extra.double(), expected, rtol=1e-4, atol=1e-7)
    first = "llm.layers.0.mlp.router.weight"
    assert not torch.allclose(with_aux["grads"][first], without["grads"][first])
