"""Whole (canonical) tensors <-> one tensor-parallel rank's piece, as megatron-core lays it out.

Why a table by name instead of reading the modules: the checkpoint converter writes and reads
Megatron checkpoints without building the model, and tests check the result against the
modules megatron-core really builds. Layouts:

- column-parallel weights (qkv, fc1, projector fc1; Qwen3-VL's DeepStack mergers are laid out
  as the projector) split along rows; a gated fc1 (the LLM's,
  a native-resolution ViT's, weight and bias) is [gate; up] and each rank holds [gate_r; up_r];
- row-parallel weights (attention output, fc2) split along columns, their biases replicated;
- the word embedding and output head split along the (padded) vocabulary;
- a mixture-of-experts layer's experts (`mlp.experts.local_experts.{e}.linear_fc1/2`) split
  like the dense MLP over the expert-tensor-parallel ranks (as many as TP), its router
  replicated;
- the ViT's heads are padded to a multiple of TP with zero dummy heads (qkv rows, attention
  output columns, QK-norm weights), which must still be zero when a checkpoint is exported.
Everything else is replicated, the LLM's per-head QK-norm weights (Qwen3) included.

LoRA adapters (`<linear>.lora_a` [rank, in], `<linear>.lora_b` [out, rank]) follow their base
layer: beside a column-parallel weight A is whole and B split (and padded) like the weight's
rows; beside a row-parallel weight A is split (and padded) like the weight's columns and B whole.
"""

from __future__ import annotations

import re

import torch

from megatron_omnibal.megatron.stages.configs import padded_heads, padded_vocab
from megatron_omnibal.models.spec import ModelSpec

_LAYER = re.compile(r"^(vit|llm)\.layers\.\d+\.")
_EXPERT = "mlp.experts.local_experts."
_DEEPSTACK = re.compile(r"^deepstack_mergers\.\d+\.")


class ShardError(ValueError):
    """Tensor-parallel pieces that do not fit together; the message names the tensor."""


def _kind(name: str) -> tuple[str, str]:
    """(tower, role) of a canonical tensor: tower vit | llm | projector | other."""
    for suffix in (".lora_a", ".lora_b"):
        if name.endswith(suffix):
            tower, role = _kind(name[: -len(suffix)] + ".weight")
            split_by_rows = role in ("qkv", "column")
            if (suffix == ".lora_b") == split_by_rows:
                return tower, role
            return tower, "replicated"
    merger = _DEEPSTACK.match(name)
    if merger:  # a DeepStack merger is laid out as the projector
        return _kind("projector." + name[merger.end() :])
    m = _LAYER.match(name)
    tower = m.group(1) if m else ("projector" if name.startswith("projector.") else "other")
    rest = name[m.end() :] if m else name
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return tower, "vocab"
    if rest.startswith("self_attention.linear_qkv."):
        return tower, "qkv"
    if rest == "self_attention.linear_proj.weight":
        return tower, "proj"
    if rest in ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"):
        # The ViT's norm spans all heads (split with them); the LLM's is per head (replicated).
        return tower, "qknorm" if tower == "vit" else "replicated"
    if rest.startswith(_EXPERT):  # a MoE layer's expert: an MLP split like the dense one
        rest = "mlp." + rest[len(_EXPERT) :].split(".", 1)[1]
    if rest.startswith("mlp.linear_fc1.") or rest.startswith("projector.mlp.linear_fc1."):
        return tower, "column"
    if rest == "mlp.linear_fc2.weight" or name == "projector.mlp.linear_fc2.weight":
        return tower, "row"
    return tower, "replicated"


def _gated(tower: str, spec: ModelSpec) -> bool:
    """Whether the tower's fc1 is a gated [gate; up] pair."""
    return (tower == "llm" and spec.llm.gated_mlp) or (tower == "vit" and spec.vit.gated_mlp)


def _pad_heads(full: torch.Tensor, spec: ModelSpec, tp: int, role: str) -> torch.Tensor:
    """The ViT tensor with zero dummy heads appended (per head: q, k, v rows for qkv)."""
    v = spec.vit
    real, total, dim = v.num_attention_heads, padded_heads(v.num_attention_heads, tp), v.head_dim
    extra = total - real
    if extra == 0:
        return full
    if role == "qkv":
        per = full.reshape(real, 3 * dim, *full.shape[1:])
        return torch.cat([per, per.new_zeros(extra, *per.shape[1:])]).reshape(-1, *full.shape[1:])
    if role == "proj":
        return torch.cat([full, full.new_zeros(full.shape[0], extra * dim)], dim=1)
    return torch.cat([full, full.new_zeros(extra * dim)])  # qknorm


def _strip_heads(full: torch.Tensor, spec: ModelSpec, role: str, name: str) -> torch.Tensor:
    v = spec.vit
    real, dim = v.num_attention_heads, v.head_dim
    if role == "qkv":
        keep, dummy = full[: real * 3 * dim], full[real * 3 * dim :]
    elif role == "proj":
        keep, dummy = full[:, : real * dim], full[:, real * dim :]
    else:
        keep, dummy = full[: real * dim], full[real * dim :]
    if dummy.numel() and bool(dummy.ne(0).any()):
        raise ShardError(
            f"{name}: the ViT's padded dummy heads are not zero; the checkpoint cannot be "
            "exported as the original architecture"
        )
    return keep


def shard(name: str, full: torch.Tensor, spec: ModelSpec, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece (of `tp`) of canonical tensor `name`."""
    tower, role = _kind(name)
    if tower == "vit" and role in ("qkv", "proj", "qknorm"):
        full = _pad_heads(full, spec, tp, role)
    if role == "vocab":
        rows = padded_vocab(spec.llm.vocab_size, tp) - full.shape[0]
        full = torch.cat([full, full.new_zeros(rows, *full.shape[1:])])
    if tp == 1 or role == "replicated":
        return full
    if role in ("row", "proj"):
        return full.chunk(tp, dim=1)[rank].contiguous()
    if role == "column" and _gated(tower, spec):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]]).contiguous()
    return full.chunk(tp, dim=0)[rank].contiguous()


def unshard(name: str, parts: list[torch.Tensor], spec: ModelSpec) -> torch.Tensor:
    """The canonical tensor `name` from every TP rank's piece (inverse of shard)."""
    tp = len(parts)
    tower, role = _kind(name)
    if tp == 1 or role == "replicated":
        full = parts[0]
        if role == "replicated" and tp > 1:
            for r, p in enumerate(parts[1:], 1):
                if not torch.equal(p, full):
                    raise ShardError(f"{name}: replicated tensor differs on TP rank {r}")
    elif role in ("row", "proj"):
        full = torch.cat(parts, dim=1)
    elif role == "column" and _gated(tower, spec):
        halves = [p.chunk(2, dim=0) for p in parts]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    else:
        full = torch.cat(parts, dim=0)
    if role == "vocab":
        full = full[: spec.llm.vocab_size]
    if tower == "vit" and role in ("qkv", "proj", "qknorm"):
        full = _strip_heads(full, spec, role, name)
    return full.contiguous()
