"""Qwen3-VL's Hugging Face tensors <-> the stage module's canonical tensors (models.hf_weights).

Why its own module: Qwen3-VL's tower differs from Qwen2.5-VL's in every block (LayerNorms with
biases, a plain MLP, a patch embedding with a bias, a learned position table) and adds the
DeepStack mergers; the family's folder takes this module as it is. Names are in the rule style
of `hf_weights.rules_for` (`visual.*`, `language_model.model.*`, `language_model.lm_head.*`);
checkpoints, as transformers 5 saves them and as the hub's are laid out, say `model.visual.*`,
`model.language_model.*` and `lm_head.*` (`FILE_STYLE`, hf_weights.detect_style's mapping).

- tower: fused qkv [Q_all; K_all; V_all] with bias -> megatron-core's per-head [q, k, v];
  LayerNorms and MLP as they are; Conv3d patch embedding with bias; `pos_embed` is the
  position table;
- merger `visual.merger` (norm of each patch, two linear layers) is the projector;
  `visual.deepstack_merger_list.<k>` (norm over the merge group) are `deepstack_mergers.<k>`;
- LLM: Qwen3 (q, k, v apart, per-head q_norm / k_norm, gated MLP, no biases).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace

import torch

from megatron_omnibal.models.hf_weights import (
    KeyStyle,
    Rule,
    _chunks_fuse,
    _chunks_split,
    _layer_rules,
    _linear,
    _norm,
    _qkv_fuse,
    _qkv_split,
    canonical_shapes,
    to_file_name,
    to_rule_name,
)
from megatron_omnibal.models.spec import ModelSpec

FILE_STYLE: KeyStyle = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
)


def _tower_rules(spec: ModelSpec) -> list[Rule]:
    v = spec.vit
    heads, layer = v.num_attention_heads, "visual.blocks.{i}"
    fuse, split = _qkv_fuse(heads, heads, v.head_dim), _qkv_split(heads, heads, v.head_dim)
    names = {
        **_norm("input_layernorm", f"{layer}.norm1", True),
        **_linear("self_attention.linear_qkv", (f"{layer}.attn.qkv",), True),
        **_linear("self_attention.linear_proj", (f"{layer}.attn.proj",), True),
        **_norm("pre_mlp_layernorm", f"{layer}.norm2", True),
        **_linear("mlp.linear_fc1", (f"{layer}.mlp.linear_fc1",), True),
        **_linear("mlp.linear_fc2", (f"{layer}.mlp.linear_fc2",), True),
    }
    rules = [
        Rule("patch_embed.conv.weight", ("visual.patch_embed.proj.weight",)),
        Rule("patch_embed.conv.bias", ("visual.patch_embed.proj.bias",)),
        Rule("patch_embed.position_table.weight", ("visual.pos_embed.weight",)),
    ]
    for i in range(v.num_layers):
        rules += _layer_rules("vit", i, names, (_chunks_fuse(fuse), _chunks_split(split)))
    return rules


def _merger_rules(canonical: str, hf: str) -> list[Rule]:
    names = {
        **_norm(f"{canonical}.norm", f"{hf}.norm", True),
        **_linear(f"{canonical}.mlp.linear_fc1", (f"{hf}.linear_fc1",), True),
        **_linear(f"{canonical}.mlp.linear_fc2", (f"{hf}.linear_fc2",), True),
    }
    return [Rule(c, h) for c, h in names.items()]


def _language_rules(spec: ModelSpec) -> list[Rule]:
    llm, base = spec.llm, "language_model.model"
    layer = f"{base}.layers.{{i}}"
    a = f"{layer}.self_attn"
    names = {
        "input_layernorm.weight": (f"{layer}.input_layernorm.weight",),
        "self_attention.linear_qkv.weight": (f"{a}.q_proj.weight", f"{a}.k_proj.weight",
                                             f"{a}.v_proj.weight"),
        "self_attention.linear_proj.weight": (f"{a}.o_proj.weight",),
        "self_attention.q_layernorm.weight": (f"{a}.q_norm.weight",),
        "self_attention.k_layernorm.weight": (f"{a}.k_norm.weight",),
        "pre_mlp_layernorm.weight": (f"{layer}.post_attention_layernorm.weight",),
        "mlp.linear_fc1.weight": (f"{layer}.mlp.gate_proj.weight", f"{layer}.mlp.up_proj.weight"),
        "mlp.linear_fc2.weight": (f"{layer}.mlp.down_proj.weight",),
    }  # fmt: skip
    qkv = (llm.num_attention_heads, llm.num_query_groups, llm.kv_channels)
    rules = [Rule("embedding.word_embeddings.weight", (f"{base}.embed_tokens.weight",))]
    for i in range(llm.num_layers):
        rules += _layer_rules("llm", i, names, (_qkv_fuse(*qkv), _qkv_split(*qkv)))
    rules.append(Rule("llm.final_layernorm.weight", (f"{base}.norm.weight",)))
    if not llm.tie_embeddings:
        rules.append(Rule("output_layer.weight", ("language_model.lm_head.weight",)))
    return rules


def qwen3_vl_rules(spec: ModelSpec) -> list[Rule]:
    """Every canonical tensor of a Qwen3-VL model with its HF tensors (rule style)."""
    deepstack = [
        r
        for k in range(len(spec.vit.deepstack_indexes))
        for r in _merger_rules(f"deepstack_mergers.{k}", f"visual.deepstack_merger_list.{k}")
    ]
    return (
        _tower_rules(spec)
        + _merger_rules("projector", "visual.merger")
        + deepstack
        + _language_rules(spec)
    )


def canonical_from_hf(
    spec: ModelSpec, state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Canonical tensors from an HF state dict (checkpoint names); a tied head's stored copy
    aside, every tensor must be used and every needed one present (KeyError naming it)."""
    named = {to_rule_name(n, FILE_STYLE): t for n, t in state.items()}
    rules = qwen3_vl_rules(spec)
    needed = {h for r in rules for h in r.hf}
    extra = set(named) - needed - {"language_model.lm_head.weight"}
    if extra:
        raise KeyError(f"tensors Qwen3-VL does not use: {sorted(extra)[:3]}")
    return {r.canonical: r.to_canonical([named[h] for h in r.hf]) for r in rules}


def hf_from_canonical(
    spec: ModelSpec, tensors: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The HF state dict (checkpoint names) of canonical tensors (inverse of canonical_from_hf)."""
    out: dict[str, torch.Tensor] = {}
    for rule in qwen3_vl_rules(spec):
        for name, t in zip(rule.hf, rule.to_hf(tensors[rule.canonical]), strict=True):
            out[to_file_name(name, FILE_STYLE)] = t
    return out


def qwen3_vl_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The shape of every canonical tensor of a Qwen3-VL model: hf_weights.canonical_shapes's,
    with the position table, the merger's LayerNorm bias and the DeepStack mergers."""
    out = canonical_shapes(SimpleNamespace(spec=spec))  # it reads the spec alone
    v, p, h = spec.vit, spec.projector, spec.llm.hidden_size
    out["patch_embed.position_table.weight"] = (v.num_position_embeddings, v.hidden_size)
    out["projector.norm.bias"] = (v.hidden_size,)
    for k in range(len(v.deepstack_indexes)):
        merger = f"deepstack_mergers.{k}"
        out.update({
            f"{merger}.norm.weight": (spec.projector_in,),
            f"{merger}.norm.bias": (spec.projector_in,),
            f"{merger}.mlp.linear_fc1.weight": (p.hidden_size, spec.projector_in),
            f"{merger}.mlp.linear_fc1.bias": (p.hidden_size,),
            f"{merger}.mlp.linear_fc2.weight": (h, p.hidden_size),
            f"{merger}.mlp.linear_fc2.bias": (h,),
        })  # fmt: skip
    return out
