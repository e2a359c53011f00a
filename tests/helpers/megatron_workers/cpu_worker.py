"""torchrun worker (2 processes) for megatron_omnibal.megatron.runtime.cpu: checks that need a
process group or that must not patch the pytest process itself. Saves its observations to
OUT/rank{r}.pt; tests/megatron/runtime/test_megatron_cpu.py asserts on them.

Usage: torchrun --nproc-per-node 2 cpu_worker.py OUT_DIR
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

from megatron_omnibal.megatron.runtime.cpu import cpu_megatron_enabled, enable_cpu_megatron

obs: dict = {"enabled_before": cpu_megatron_enabled(), "enable": enable_cpu_megatron()}
obs["enable_again"] = enable_cpu_megatron()
obs["gc_enabled_after"] = gc.isenabled()  # paused while megatron loads, then on again

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel import (  # noqa: E402
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from parallel_groups import reset_model_parallel  # noqa: E402

# Before any optimizer exists (torch.optim's add_param_group imports torch._dynamo itself).
obs["dynamo_after_imports"] = "torch._dynamo" in sys.modules

SEED = 99


def device_checks() -> None:
    obs["factory_device"] = str(torch.zeros(2, device="cuda").device)
    obs["current_device_factory"] = str(torch.empty(2, device=torch.cuda.current_device()).device)
    obs["tensor_cuda"] = str(torch.ones(2).cuda().device)
    obs["tensor_to_cuda"] = str(torch.ones(2).to("cuda").device)
    obs["module_cuda"] = str(next(torch.nn.Linear(2, 2).cuda().parameters()).device)
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    with torch.cuda.stream(torch.cuda.Stream()):
        ev1.record()
    obs["event_ms"] = ev0.elapsed_time(ev1)


def tracker_checks() -> None:
    """Inside fork(name) the draws come from the tracked stream, outside from the default one."""
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(5)
    tracker.add("stream-a", 42)
    before = torch.rand(3)
    with tracker.fork("stream-a"):
        inside = torch.rand(4)
    after = torch.rand(3)
    with tracker.fork("stream-a"):
        inside2 = torch.rand(4)
    obs["tracker"] = {"before": before, "inside": inside, "after": after, "inside2": inside2}


def gpt_config(pp: int, recompute: bool, dropout: float) -> TransformerConfig:
    extra = (
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}
        if recompute
        else {}
    )
    return TransformerConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        **extra,
    )


def gpt_run(pp: int, recompute: bool, dropout: float) -> dict:
    """Tiny GPTModel trained one step by Megatron's schedule (1F1B when pp > 1)."""
    reset_model_parallel()
    ps.initialize_model_parallel(1, pp)
    model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    rank = ps.get_pipeline_model_parallel_rank()
    model = GPTModel(
        gpt_config(pp, recompute, dropout),
        get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
        pre_process=rank == 0,
        post_process=rank == pp - 1,
        share_embeddings_and_output_weights=False,
    )

    def name(n: str) -> str:
        parts = n.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
        return ".".join(parts)

    named = {name(n): p for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(SEED)
    weights = torch.load(OUT / "gpt_weights.pt") if (OUT / "gpt_weights.pt").exists() else None
    with torch.no_grad():
        for n, p in named.items():
            if weights is not None:
                p.copy_(weights[n])
    data = [torch.randint(0, 64, (1, 16), generator=g) for _ in range(4)]

    def step(it, m):
        tok = next(it)
        out = m(tok, torch.arange(16)[None], None, labels=tok)

        def loss(o):
            return o.sum(), torch.tensor(o.numel(), dtype=torch.int), {"l": o.sum().detach()}

        return out, loss

    model_parallel_cuda_manual_seed(SEED + 1)
    torch.manual_seed(SEED + 1)
    model.config.calculate_per_token_loss = True
    losses = get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(data),
        model=[model],
        num_microbatches=4,
        seq_length=16,
        micro_batch_size=1,
    )
    if weights is None and dist.get_rank() == 0:
        torch.save({n: p.detach() for n, p in named.items()}, OUT / "gpt_weights.pt")
    return {
        "losses": [float(x["l"]) for x in losses] if losses else [],
        "grads": {n: p.grad.detach().clone() for n, p in named.items()},
    }


def ddp_grads(ddp, opt, named: dict, data: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zero the grads, run Megatron's schedule over `data` (one micro-batch each, summed token
    loss) and finalize: the DP-reduced main grads, before any optimizer step."""
    from megatron.core.distributed import finalize_model_grads

    def step(it, m):
        tok = next(it)
        out = m(tok, torch.arange(16)[None], None, labels=tok)
        return out, lambda o: (o.sum(), torch.tensor(o.numel(), dtype=torch.int), {})

    ddp.zero_grad_buffer()
    opt.zero_grad()
    get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iter(data),
        model=[ddp],
        num_microbatches=len(data),
        seq_length=16,
        micro_batch_size=1,
    )
    finalize_model_grads([ddp])
    return {n: p.main_grad.detach().clone() for n, p in named.items()}


def clip_grad_run(tp: int, pp: int) -> dict:
    """One optimizer step of Megatron's DDP + FP32Optimizer with --clip-grad 1.0 (SGD, lr 1).

    Same weights (PP=1's, sharded along each parameter's partition_dim for TP) and data as
    gpt_run. Records the grads before the step (unclipped), after it (clipped in place), the
    grad norm and zero count Megatron returns, and which parameters are TP shards.
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    reset_model_parallel()
    ps.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(SEED)
    rank = ps.get_pipeline_model_parallel_rank()
    config = gpt_config(pp, False, 0.0)
    config.tensor_model_parallel_size = tp
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
        pre_process=rank == 0,
        post_process=rank == pp - 1,
        share_embeddings_and_output_weights=False,
    )
    weights = torch.load(OUT / "gpt_weights.pt")
    tp_rank = ps.get_tensor_model_parallel_rank()
    named = {}
    with torch.no_grad():
        for n, p in model.named_parameters():
            parts = n.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
            named[".".join(parts)] = p
            full = weights[".".join(parts)]
            if getattr(p, "tensor_model_parallel", False):
                full = full.chunk(tp, dim=p.partition_dim)[tp_rank]
            p.copy_(full)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="sgd", lr=1.0, sgd_momentum=0.0, weight_decay=0.0, clip_grad=1.0,
            log_num_zeros_in_grad=True,
        ),
        [ddp],
    )  # fmt: skip
    g = torch.Generator().manual_seed(SEED)
    data = [torch.randint(0, 64, (1, 16), generator=g) for _ in range(4)]

    config.calculate_per_token_loss = True
    unclipped = ddp_grads(ddp, opt, named, data)
    _, grad_norm, zeros = opt.step()
    return {
        "grad_norm": float(grad_norm),
        "zeros": int(zeros),
        "unclipped": unclipped,
        "clipped": {n: p.grad.detach().clone() for n, p in named.items()},
        "tp_dim": {
            n: p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
            for n, p in named.items()
        },
        "tp_rank": tp_rank,
    }


def optimizer_step_run(distributed: bool, bf16: bool) -> dict:
    """Two Adam steps (lr 1e-2) of Megatron's DDP + optimizer at DP=2 (TP=PP=1), each rank on
    its own data: --use-distributed-optimizer (DistributedOptimizer, its state saved and loaded
    between the steps as a resume does) or not, --bf16 (Float16Module, bf16 grad buffers,
    Float16OptimizerWithFloat16Params' fp32 main params) or fp32. Same start weights as
    gpt_run. Records the weights before and after the first step, the all-reduced grads it
    used, without the distributed optimizer the fp32 main params, and the weights after the
    second step.
    """
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    reset_model_parallel()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(SEED)
    config = gpt_config(1, False, 0.0)
    if bf16:
        config.bf16 = True
        config.params_dtype = config.pipeline_dtype = torch.bfloat16
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
        share_embeddings_and_output_weights=False,
    )
    named = dict(model.named_parameters())
    weights = torch.load(OUT / "gpt_weights.pt")
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(weights[n])
    wrapped = Float16Module(config, model) if bf16 else model
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed)
    ddp = DistributedDataParallel(config, ddp_config, wrapped)
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=1e-2, weight_decay=0.0, clip_grad=0.0, bf16=bf16,
            params_dtype=config.params_dtype, use_distributed_optimizer=distributed,
        ),
        [ddp],
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in named.items()}
    g = torch.Generator().manual_seed(SEED + 10 + dist.get_rank())

    def train_step() -> tuple[bool, dict[str, torch.Tensor]]:
        data = [torch.randint(0, 64, (1, 16), generator=g) for _ in range(2)]
        grads = ddp_grads(ddp, opt, named, data)
        return opt.step()[0], grads

    config.calculate_per_token_loss = True
    ok, grads = train_step()
    run = {
        "ok": bool(ok),
        "optimizers": [type(o).__name__ for o in getattr(opt, "chained_optimizers", [opt])],
        "before": before,
        "grads": grads,
        "after": {n: p.detach().clone() for n, p in named.items()},
        "main": {} if distributed else {
            n: (p.main_param if bf16 else p).detach().clone() for n, p in named.items()
        },
    }  # fmt: skip
    if distributed:  # what a --ckpt-format torch save and resume do with the optimizer
        state = opt.state_dict()
        opt.save_parameter_state(str(OUT / "dist_optimizer_state.pt"))
        dist.barrier()
        opt.load_state_dict(state)
        opt.load_parameter_state(str(OUT / "dist_optimizer_state.pt"))
    train_step()
    run["after_second"] = {n: p.detach().clone() for n, p in named.items()}
    return run


def clip_check() -> None:
    """CLIPViTModel without Transformer Engine: builds its ln_pre and runs."""
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec

    reset_model_parallel()
    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(SEED)
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
    )
    model = CLIPViTModel(cfg, get_vit_layer_with_local_spec(), patch_dim=4, img_h=16, img_w=16)
    out = model(torch.randn(2, 3, 16, 16))
    obs["clip_out_shape"] = list(out.shape)


def training_import() -> None:
    import megatron.training.training as training  # needs typing.override on Python 3.11

    obs["training_initialize_patched"] = getattr(
        training.initialize_megatron, "__omnibal_cpu__", False
    )


def startup_checks() -> None:
    """Megatron's parser takes its help texts from the sources once per process (the same texts
    as megatron's own reader); a torch_dist writer's results queue lives in a forked process
    (a spawned one has another command line: a fresh interpreter)."""
    import argparse
    import inspect
    import multiprocessing

    import psutil
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.training.argument_utils import ArgumentGroupFactory
    from megatron.training.arguments import add_megatron_arguments

    read = ArgumentGroupFactory._get_field_docstrings
    factory = ArgumentGroupFactory(TransformerConfig)
    docs = read(factory, TransformerConfig)
    obs["field_docs_same"] = bool(docs) and docs == read.__wrapped__(factory, TransformerConfig)
    add_megatron_arguments(argparse.ArgumentParser())
    calls, getsource = [], inspect.getsource
    inspect.getsource = lambda *a, **k: calls.append(a) or getsource(*a, **k)
    try:
        add_megatron_arguments(argparse.ArgumentParser())
    finally:
        inspect.getsource = getsource
    obs["getsource_calls_second_parser"] = len(calls)
    before = {p.pid for p in multiprocessing.active_children()}
    filesystem_async.get_write_results_queue()
    mine = psutil.Process().cmdline()
    obs["results_queue_processes_forked"] = [psutil.Process(p.pid).cmdline() == mine
                                             for p in multiprocessing.active_children()
                                             if p.pid not in before]  # fmt: skip


def compile_checks() -> None:
    """TORCHDYNAMO_DISABLE=1 (launch.py sets it): megatron.core's jit_fuser functions are the
    plain ones, and neither importing megatron.core nor training loaded torch._inductor's
    compiler; torch.compile hands a function back as is, as torch does then. Without it,
    torch.compile's own wrapper. Runs last."""
    import os

    from megatron.core.fusions.fused_bias_geglu import geglu

    obs["dynamo_disabled"] = os.environ.get("TORCHDYNAMO_DISABLE")
    obs["inductor_compiler_imported"] = "torch._inductor.compile_fx" in sys.modules
    obs["fused_is_plain"] = type(geglu).__name__ == "function" and hasattr(geglu, "__code__")
    obs["compile_same"] = torch.compile(geglu) is geglu
    obs["compile_decorator_same"] = torch.compile(mode="default")(geglu) is geglu
    del os.environ["TORCHDYNAMO_DISABLE"]
    obs["compile_enabled_wraps"] = torch.compile(geglu, backend="eager") is not geglu


if __name__ == "__main__":
    OUT = Path(sys.argv[1])
    dist.init_process_group("gloo")
    device_checks()
    tracker_checks()
    clip_check()
    training_import()
    startup_checks()
    for pp, rec, drop in ((1, False, 0.0), (2, False, 0.0), (2, False, 0.1), (2, True, 0.1)):
        obs[f"gpt_pp{pp}_recompute{int(rec)}_dropout{drop}"] = gpt_run(pp, rec, drop)
        dist.barrier()
    for tp, pp in ((1, 1), (1, 2), (2, 1)):
        obs[f"clip_tp{tp}_pp{pp}"] = clip_grad_run(tp, pp)
        dist.barrier()
    for distributed in (False, True):
        for bf16 in (False, True):
            run = optimizer_step_run(distributed, bf16)
            obs[f"opt_{'dist' if distributed else 'plain'}_{'bf16' if bf16 else 'fp32'}"] = run
            dist.barrier()
    obs["tensor_types_after"] = [
        torch.ones(1, dtype=t).type() for t in (torch.float, torch.bfloat16)
    ]
    compile_checks()
    torch.save(obs, OUT / f"rank{dist.get_rank()}.pt")
    ps.destroy_model_parallel()
    dist.destroy_process_group()
