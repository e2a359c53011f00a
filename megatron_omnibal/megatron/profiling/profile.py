"""Measure real megatron-core transformer layers: forward, backward, recompute, memory.

Why: the planner's analytic FLOPs model assumes an efficiency; a profile replaces assumptions by
measurements on the device at hand (a GPU, or the CPU with small shapes, same code). One ViT
layer and one LLM layer are built from megatron-core's GPT layer spec (local torch modules, or
Transformer Engine when importable) and timed on a micro-batch of `tiles` tiles and `tokens`
tokens; all layers of a tower share the shape, so each tower's numbers stand for all its layers.
The patch embedding is added to the first ViT layer and the output layer + loss to the last LLM
layer, as the layer profile format has only layers.

Memory is measured, not modelled: the bytes of the tensors autograd saves during the forward
(distinct storages), once plainly and once under megatron-core's recompute checkpoint, whose
saved tensors are what a recomputed layer still stores. Static memory (`weight_mib`) is the
layer's parameter count (also written, as `params`) times the bytes of BF16 weights, FP32
gradients and Adam state sharded over `dp` (the distributed optimizer), since the profile run
itself does not train. `measured` records the device, dtype, tiles and tokens of the run, which
lets `omnibal plan --profile` scale the numbers to other micro-batches.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from collections.abc import Callable

import torch

from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron
from megatron_omnibal.megatron.runtime.ports import free_port
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.cost_model.memory import static_bytes_per_param
from megatron_omnibal.preflight.measure import SavedTensorTracker, sync_device

MIB = 2.0**20


def _init_single_process() -> None:
    """A one-rank gloo/nccl group and megatron-core's model-parallel state (TP = PP = 1)."""
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


def _layer(
    hidden: int,
    ffn: int,
    heads: int,
    groups: int,
    norm: str,
    gated: bool,
    causal: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.nn.Module:
    """One megatron-core TransformerLayer with this tower's shape and attention mask type."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        num_query_groups=groups,
        normalization="RMSNorm" if norm == "rmsnorm" else "LayerNorm",
        gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu,
        add_bias_linear=not gated,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec()
    except ImportError:
        spec = get_gpt_layer_local_spec(normalization=config.normalization)
    spec = copy.deepcopy(spec)
    attn = spec.submodules.self_attention
    attn.params = {
        **attn.params,
        "attn_mask_type": AttnMaskType.causal if causal else AttnMaskType.no_mask,
    }
    return build_module(spec, config=config, layer_number=1).to(device)


def _saved_bytes(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run `fn` and count the bytes of the distinct storages autograd saves for backward (all
    still held when it returns: the peak)."""
    tracker = SavedTensorTracker()
    with tracker.hooks():
        out = fn()
    return out, tracker.peak


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall ms of `fn` over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        sync_device()
        t0 = time.perf_counter()
        fn()
        sync_device()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_module(
    forward: Callable[[torch.Tensor], torch.Tensor],
    params: list,
    x: torch.Tensor,
    repeats: int,
    recomputable: bool = True,
) -> dict:
    """Forward, backward and recompute ms, saved MiB plain and checkpointed, output MiB."""
    from megatron.core.tensor_parallel.random import checkpoint

    x = x.detach().requires_grad_(True)
    grad = torch.randn_like(forward(x).detach())

    def fwd() -> torch.Tensor:
        return forward(x)

    def fwd_bwd() -> None:
        forward(x).backward(grad)

    def ckpt_fwd_bwd() -> None:
        checkpoint(forward, False, x).backward(grad)

    f_ms = _time(fwd, repeats)
    fb_ms = _time(fwd_bwd, repeats)
    out, act = _saved_bytes(fwd)
    row = {
        "forward_ms": f_ms,
        "backward_ms": max(fb_ms - f_ms, 0.0),
        "activation_mib": act / MIB,
        "output_mib": out.numel() * out.element_size() / MIB,
        "params": sum(p.numel() for p in params),
    }
    if recomputable:
        ck_ms = _time(ckpt_fwd_bwd, repeats)
        _, kept = _saved_bytes(lambda: checkpoint(forward, False, x))
        row["recompute_ms"] = max(ck_ms - fb_ms, 0.0)
        row["checkpoint_mib"] = kept / MIB
    return row


def profile_model(
    model: ModelSpec,
    tiles: int = 4,
    tokens: int = 256,
    repeats: int = 3,
    dp: int = 1,
    micro_batches: int = 8,
    memory_budget_gib: float | None = None,
    dtype: torch.dtype | None = None,
) -> dict:
    """The layer profile (docs/planner.md) of `model`, measured on this machine's device."""
    enable_cpu_megatron()
    _init_single_process()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    torch.manual_seed(0)
    vit, lm, xl = _measure_transformer_layers(model, tiles, tokens, repeats, dtype, device)
    proj, head, patch = _measure_other_parts(model, tiles, xl, repeats, dtype, device)
    doc = {
        "micro_batches": micro_batches,
        "layers": _profile_layers(model, vit, lm, proj, head, patch, static_bytes_per_param(dp)),
        "measured": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "dtype": str(dtype).replace("torch.", ""),
            "tiles": tiles,
            "tokens": tokens,
            "repeats": repeats,
            "model": model.name,
            "vit_layer_params": vit["params"],
            "llm_layer_params": lm["params"],
            "torch_threads": torch.get_num_threads(),
        },
    }
    if memory_budget_gib is not None:
        doc["memory_budget_gib"] = memory_budget_gib
    return doc


def _measure_transformer_layers(
    model: ModelSpec,
    tiles: int,
    tokens: int,
    repeats: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[dict, dict, torch.Tensor]:
    """One ViT layer on `tiles` tiles and one LLM layer on `tokens` tokens, measured; also the
    LLM layer's input, which the head is measured on."""
    v, llm = model.vit, model.llm
    vit_layer = _layer(
        v.hidden_size,
        v.ffn_hidden_size,
        v.num_attention_heads,
        v.num_attention_heads,
        v.norm,
        False,
        False,
        dtype,
        device,
    )
    llm_layer = _layer(
        llm.hidden_size,
        llm.ffn_hidden_size,
        llm.num_attention_heads,
        llm.num_query_groups,
        llm.norm,
        llm.gated_mlp,
        True,
        dtype,
        device,
    )
    xv = torch.randn(v.seq_per_tile, tiles, v.hidden_size, dtype=dtype, device=device)
    xl = torch.randn(tokens, 1, llm.hidden_size, dtype=dtype, device=device)
    vit = measure_module(
        lambda x: vit_layer(x, attention_mask=None)[0],
        list(vit_layer.parameters()),
        xv,
        repeats,
    )
    lm = measure_module(
        lambda x: llm_layer(x, attention_mask=None)[0],
        list(llm_layer.parameters()),
        xl,
        repeats,
    )
    return vit, lm, xl


def _measure_other_parts(
    model: ModelSpec,
    tiles: int,
    xl: torch.Tensor,
    repeats: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[dict, dict, dict]:
    """The projector, the output head with its loss (on `xl`) and the patch embedding,
    measured without recompute (the planner pins them to their layers)."""
    v, llm = model.vit, model.llm
    proj_in, proj_mid = model.projector_in, model.projector_hidden
    projector = torch.nn.Sequential(
        torch.nn.LayerNorm(proj_in),
        torch.nn.Linear(proj_in, proj_mid),
        torch.nn.GELU(),
        torch.nn.Linear(proj_mid, llm.hidden_size),
    ).to(device, dtype)
    xp = torch.randn(tiles * model.tokens_per_tile, proj_in, dtype=dtype, device=device)
    proj = measure_module(projector, list(projector.parameters()), xp, repeats, False)
    head = torch.nn.Linear(llm.hidden_size, llm.vocab_size, bias=False).to(device, dtype)
    labels = torch.randint(0, llm.vocab_size, (xl.shape[0],), device=device)
    head_row = measure_module(
        lambda x: torch.nn.functional.cross_entropy(
            head(x[:, 0]).float(), labels, reduction="none"
        ),
        list(head.parameters()),
        xl,
        repeats,
        False,
    )
    patch = torch.nn.Conv2d(3, v.hidden_size, v.patch_size, v.patch_size).to(device, dtype)
    img = torch.randn(tiles, 3, v.image_size, v.image_size, dtype=dtype, device=device)
    patch_row = measure_module(patch, list(patch.parameters()), img, repeats, False)
    return proj, head_row, patch_row


def _profile_layers(
    model: ModelSpec,
    vit: dict,
    lm: dict,
    proj: dict,
    head: dict,
    patch: dict,
    bytes_per_param: float,
) -> list[dict]:
    """The profile's layers in model order: the patch embedding is added to the first ViT
    layer, the word embedding's weights to the projector, the head to the last LLM layer."""
    per_param = bytes_per_param / MIB

    def entry(name: str, row: dict, group: str, extra: dict | None = None) -> dict:
        out = {
            "name": name,
            "group": group,
            "forward_ms": row["forward_ms"],
            "backward_ms": row["backward_ms"],
            "recompute_ms": row.get("recompute_ms", 0.0),
            "activation_mib": row["activation_mib"],
            "checkpoint_mib": row.get("checkpoint_mib", row["activation_mib"]),
            "output_mib": row["output_mib"],
            "weight_mib": row["params"] * per_param,
            "params": row["params"],
        }
        for key, value in (extra or {}).items():
            out[key] += value
        return out

    def pinned(row: dict) -> dict:
        return {
            "forward_ms": row["forward_ms"],
            "backward_ms": row["backward_ms"],
            "activation_mib": row["activation_mib"],
            "checkpoint_mib": row["activation_mib"],
            "weight_mib": row["params"] * per_param,
            "params": row["params"],
        }

    v, llm = model.vit, model.llm
    layers = [
        entry(f"vit.{i}", vit, "vit", pinned(patch) if i == 0 else None)
        for i in range(v.num_layers)
    ]
    embed_params = llm.vocab_size * llm.hidden_size
    embed = {"weight_mib": embed_params * per_param, "params": embed_params}
    layers.append(entry("projector", proj, "none", embed))
    layers += [
        entry(f"llm.{i}", lm, "llm", pinned(head) if i == llm.num_layers - 1 else None)
        for i in range(llm.num_layers)
    ]
    return layers
