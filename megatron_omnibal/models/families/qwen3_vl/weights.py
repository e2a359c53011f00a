"""Qwen3-VL's tensors <-> canonical tensors (models.hf_weights).

Names are in the rule style of `hf_weights.rules_for` (`visual.*`, `language_model.model.*`,
`language_model.lm_head.*`); checkpoints, as transformers 5 saves them and as the hub's are laid
out, say `model.visual.*`, `model.language_model.*` and `lm_head.*` (`FILE_STYLE`, the family's
key style).

- tower: fused qkv [Q_all; K_all; V_all] with bias -> megatron-core's per-head [q, k, v];
  LayerNorms (with biases) and a plain MLP as they are; a Conv3d patch embedding with a bias;
  `pos_embed` is the position table;
- the merger `visual.merger` (LayerNorm of each patch, two linear layers) is the projector;
  `visual.deepstack_merger_list.<k>` (LayerNorm over the merge group) are `deepstack_mergers.<k>`;
- LLM: Qwen3's (the shared rules).
"""

from __future__ import annotations

from pathlib import Path

from megatron_omnibal.models.families.family import KeyStyle
from megatron_omnibal.models.families.shared.config import HFModel
from megatron_omnibal.models.families.shared.weights import (
    Rule,
    chunks_fuse,
    chunks_split,
    language_rules,
    layer_rules,
    linear,
    norm,
    qkv_fuse,
    qkv_split,
)
from megatron_omnibal.models.spec import ModelSpec, VisionSpec

FILE_STYLE: KeyStyle = (
    ("model.language_model.", "language_model.model."),
    ("model.visual.", "visual."),
    ("lm_head.", "language_model.lm_head."),
)


def vision_rules(model: HFModel) -> list[Rule]:
    v = model.spec.vit
    heads, layer = v.num_attention_heads, "visual.blocks.{i}"
    fuse, split = qkv_fuse(heads, heads, v.head_dim), qkv_split(heads, heads, v.head_dim)
    names = {
        **norm("input_layernorm", f"{layer}.norm1", True),
        **linear("self_attention.linear_qkv", (f"{layer}.attn.qkv",), True),
        **linear("self_attention.linear_proj", (f"{layer}.attn.proj",), True),
        **norm("pre_mlp_layernorm", f"{layer}.norm2", True),
        **linear("mlp.linear_fc1", (f"{layer}.mlp.linear_fc1",), True),
        **linear("mlp.linear_fc2", (f"{layer}.mlp.linear_fc2",), True),
    }
    rules = [
        Rule("patch_embed.conv.weight", ("visual.patch_embed.proj.weight",)),
        Rule("patch_embed.conv.bias", ("visual.patch_embed.proj.bias",)),
        Rule("patch_embed.position_table.weight", ("visual.pos_embed.weight",)),
    ]
    for i in range(v.num_layers):
        rules += layer_rules("vit", i, names, (chunks_fuse(fuse), chunks_split(split)))
    return rules


def _merger(canonical: str, hf: str) -> list[Rule]:
    names = {
        **norm(f"{canonical}.norm", f"{hf}.norm", True),
        **linear(f"{canonical}.mlp.linear_fc1", (f"{hf}.linear_fc1",), True),
        **linear(f"{canonical}.mlp.linear_fc2", (f"{hf}.linear_fc2",), True),
    }
    return [Rule(c, h) for c, h in names.items()]


def projector(model: HFModel) -> list[Rule]:
    """The merger and the DeepStack mergers."""
    deepstack = [
        r
        for k in range(len(model.spec.vit.deepstack_indexes))
        for r in _merger(f"deepstack_mergers.{k}", f"visual.deepstack_merger_list.{k}")
    ]
    return _merger("projector", "visual.merger") + deepstack


def patch_shapes(v: VisionSpec) -> dict[str, tuple[int, ...]]:
    """A Conv3d over `temporal_patch_size` frames of a patch and the position table."""
    kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)
    return {
        "patch_embed.conv.weight": (v.hidden_size, 3, *kernel),
        "patch_embed.position_table.weight": (v.num_position_embeddings, v.hidden_size),
    }


def _model(spec: ModelSpec) -> HFModel:
    return HFModel(path=Path("."), spec=spec, family="qwen3_vl", llm_arch="qwen3",
                   vit_checkpoint_layers=spec.vit.num_layers)  # fmt: skip


def rules(spec: ModelSpec) -> list[Rule]:
    """Every canonical tensor of a Qwen3-VL model with its HF tensors (rule style)."""
    model = _model(spec)
    return vision_rules(model) + projector(model) + language_rules(model)
