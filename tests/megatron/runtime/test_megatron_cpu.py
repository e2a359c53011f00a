"""megatron_omnibal.megatron.runtime.cpu: real megatron-core on a CPU-only torch with gloo.

The checks run in a 2-process torchrun (so the pytest process itself is never patched); the
oracles are a PP=1 run (for 1F1B at PP=2), the run without recompute (for recompute with
dropout), a torch.Generator seeded like the RNG tracker's stream, and torch's L2 norm of the
whole model's gradients (for Megatron's gradient clipping at PP=2 and TP=2), the plain
optimizer's step (for --use-distributed-optimizer at DP=2) and torch's AdamW on the same grads
(for the step itself, fp32 and --bf16's fp32 main params).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_ranks  # noqa: E402

WORKER = Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers" / "cpu_worker.py"


@pytest.fixture(scope="module")
def obs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("cpu")
    code, stdout, stderr = run_ranks(WORKER, 2, [str(out)], timeout=180, torchrun=True)
    if code:
        pytest.fail(f"cpu worker failed ({code}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def merged(obs: list[dict], key: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses (last stage) and every gradient by global name, over both ranks."""
    losses = obs[0][key]["losses"] or obs[1][key]["losses"]
    grads = dict(obs[0][key]["grads"])
    for k, v in obs[1][key]["grads"].items():
        if k in grads:  # PP=1 runs: both ranks hold the whole model (data-parallel copies)
            assert torch.equal(grads[k], v)
        grads[k] = v
    return losses, grads


def assert_same_run(a: tuple, b: tuple, rtol: float = 1e-5) -> None:
    la, ga = a
    lb, gb = b
    assert len(la) == len(lb) == 4
    assert la == pytest.approx(lb, rel=rtol)
    assert set(ga) == set(gb)
    for k in ga:
        assert gb[k].abs().max() > 0, k
        assert (ga[k] - gb[k]).abs().max() <= rtol * gb[k].abs().max(), k


def test_enable_is_idempotent_on_cpu(obs: list[dict]) -> None:
    for o in obs:
        assert o["enabled_before"] is False
        assert o["enable"] is True and o["enable_again"] is True
        assert o["gc_enabled_after"] is True


def test_disabled_compile_skips_dynamo_and_enabled_compile_still_wraps(obs: list[dict]) -> None:
    for o in obs:
        assert o["dynamo_disabled"] == "1"
        assert o["dynamo_after_imports"] is False, "megatron.core's import loaded torch._dynamo"
        assert o["inductor_compiler_imported"] is False
        assert o["fused_is_plain"] and o["compile_same"] and o["compile_decorator_same"]
        assert o["compile_enabled_wraps"] is True


def test_help_texts_are_read_once_and_the_checkpoint_queue_is_forked(obs: list[dict]) -> None:
    for o in obs:
        assert o["field_docs_same"] is True
        assert o["getsource_calls_second_parser"] == 0
        assert o["results_queue_processes_forked"] == [True]


def test_cuda_device_uses_land_on_cpu(obs: list[dict]) -> None:
    o = obs[0]
    for key in (
        "factory_device",
        "current_device_factory",
        "tensor_cuda",
        "tensor_to_cuda",
        "module_cuda",
    ):
        assert o[key] == "cpu", key
    assert o["event_ms"] >= 0.0


def test_rng_tracker_forks_its_own_stream(obs: list[dict]) -> None:
    t = obs[0]["tracker"]
    stream = torch.Generator().manual_seed(42)
    assert torch.equal(t["inside"], torch.rand(4, generator=stream))
    assert torch.equal(t["inside2"], torch.rand(4, generator=stream))  # the stream continues
    default = torch.Generator().manual_seed(5)
    assert torch.equal(t["before"], torch.rand(3, generator=default))
    assert torch.equal(t["after"], torch.rand(3, generator=default))  # fork left it untouched


def test_gpt_1f1b_pp2_matches_pp1(obs: list[dict]) -> None:
    assert_same_run(
        merged(obs, "gpt_pp2_recompute0_dropout0.0"), merged(obs, "gpt_pp1_recompute0_dropout0.0")
    )


def test_recompute_with_dropout_matches_no_recompute(obs: list[dict]) -> None:
    drop = merged(obs, "gpt_pp2_recompute0_dropout0.1")
    assert_same_run(merged(obs, "gpt_pp2_recompute1_dropout0.1"), drop)
    plain = merged(obs, "gpt_pp2_recompute0_dropout0.0")
    assert drop[0] != pytest.approx(plain[0], rel=1e-4)  # dropout was really on


def test_clip_vit_builds_without_transformer_engine(obs: list[dict]) -> None:
    # [batch, 16 patches + 1 class token, hidden]
    assert obs[0]["clip_out_shape"] == [2, 17, 32]


def test_megatron_training_imports_and_allows_no_cuda(obs: list[dict]) -> None:
    assert obs[0]["training_initialize_patched"] is True


def full_grads(obs: list[dict], key: str, which: str) -> dict[str, torch.Tensor]:
    """Whole-model gradients by global name: TP shards concatenated along their partition dim,
    copies held by several ranks (DP replicas, TP duplicates) checked equal and taken once."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int | None] = {}
    for o in obs:
        run = o[key]
        for name, grad in run[which].items():
            held = shards.setdefault(name, {})
            dims[name] = run["tp_dim"][name]
            rank = run["tp_rank"] if dims[name] is not None else 0
            if rank in held:
                assert torch.equal(held[rank], grad), name
            held[rank] = grad
    return {
        n: torch.cat([s[r] for r in sorted(s)], dim=dims[n]) if dims[n] is not None else s[0]
        for n, s in shards.items()
    }


@pytest.mark.parametrize("key", ["clip_tp1_pp1", "clip_tp1_pp2", "clip_tp2_pp1"])
def test_grad_clipping_matches_plain_torch(obs: list[dict], key: str) -> None:
    """--clip-grad 1.0 through Megatron's DDP + optimizer: the norm it reports (all-reduced over
    the PP/TP ranks, TP duplicates once) is torch's norm of the whole model's gradients, the
    gradients are scaled by 1 / norm, and the zero count is the model's."""
    oracle = full_grads(obs, "clip_tp1_pp1", "unclipped")  # PP=1: each rank has every gradient
    grads = full_grads(obs, key, "unclipped")
    assert set(grads) == set(oracle)
    for n, g in grads.items():
        assert (g - oracle[n]).abs().max() <= 1e-5 * oracle[n].abs().max() + 1e-12, n
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in oracle.values())).item()
    assert norm > 10.0  # clipping to 1.0 really scales
    for o in obs:
        assert o[key]["grad_norm"] == pytest.approx(norm, rel=1e-5)
        assert o[key]["zeros"] == sum(int((g == 0).sum()) for g in grads.values())
    coeff = 1.0 / (norm + 1e-6)
    clipped = full_grads(obs, key, "clipped")
    for n, g in clipped.items():
        assert torch.allclose(g, grads[n] * coeff, rtol=1e-5, atol=1e-9), n


OPTIMIZER_CLASS = {
    ("plain", "fp32"): "FP32Optimizer",
    ("plain", "bf16"): "Float16OptimizerWithFloat16Params",
    ("dist", "fp32"): "DistributedOptimizer",
    ("dist", "bf16"): "DistributedOptimizer",
}


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_distributed_optimizer_step_matches_plain_optimizer(obs: list[dict], prec: str) -> None:
    """--use-distributed-optimizer at DP=2 (reduce-scatter, each rank steps its half of the
    parameters, all-gather): every rank ends with the weights of the plain optimizer's step,
    and again after a second step that follows a save and load of the optimizer state (as a
    resume does: torch AdamW's per-parameter step count and moments restored)."""
    plain = obs[0][f"opt_plain_{prec}"]
    for o in obs:  # the optimizers' constructors named CPU tensors as CUDA ones only inside
        assert o["tensor_types_after"] == ["torch.FloatTensor", "torch.BFloat16Tensor"]
        for kind in ("plain", "dist"):
            assert o[f"opt_{kind}_{prec}"]["optimizers"] == [OPTIMIZER_CLASS[kind, prec]]
            assert o[f"opt_{kind}_{prec}"]["ok"] is True
        dist_run = o[f"opt_dist_{prec}"]
        for n, w in plain["after"].items():
            assert w.dtype == (torch.bfloat16 if prec == "bf16" else torch.float32), n
            assert (w - plain["before"][n]).abs().max() > 1e-3, n  # the step moved it
            assert (dist_run["after"][n].float() - w.float()).abs().max() <= 1e-6, n
            second = plain["after_second"][n]
            assert (second - w).abs().max() > 1e-3, n
            assert (dist_run["after_second"][n].float() - second.float()).abs().max() <= 1e-6, n


@pytest.mark.parametrize("prec", ["fp32", "bf16"])
def test_optimizer_step_matches_torch_adamw(obs: list[dict], prec: str) -> None:
    """The step Megatron took (fp32 main params: --bf16's copies of the bf16 weights) is torch's
    fp32 AdamW from the same (bf16-rounded) start weights on the same DP-reduced (bf16) grads,
    and --bf16's model weights are those main params rounded to bf16."""
    run = obs[0][f"opt_plain_{prec}"]
    for n, g in run["grads"].items():  # each rank trained on its own data: the DP reduction
        assert torch.equal(g, obs[1][f"opt_plain_{prec}"]["grads"][n]), n
        assert g.dtype == run["before"][n].dtype and g.abs().max() > 0, n
    start = {n: w.float().clone().requires_grad_(True) for n, w in run["before"].items()}
    adam = torch.optim.AdamW(start.values(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
    for n, w in start.items():
        w.grad = run["grads"][n].float()
    adam.step()
    for n, w in start.items():
        main = run["main"][n]
        assert main.dtype == torch.float32, n
        assert (main - w.detach()).abs().max() <= 1e-6 * max(1.0, w.abs().max().item()), n
        assert torch.equal(run["after"][n], main.to(run["after"][n].dtype)), n
