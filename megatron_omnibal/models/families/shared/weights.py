"""What every family's weight rules share: the `Rule` tying one canonical tensor to its HF
tensors, the conversions between HF's and megatron-core's layouts, and the LLM's rules.

Conversions (both ways):
- attention: HF keeps q, k, v apart (transformers), or fused as [Q_all; K_all; V_all]
  (OpenGVLab's InternViT, Qwen's vision towers); megatron-core fuses them per KV group as
  [q heads of the group, k, v] (InternLM2's `wqkv` already is that layout);
- gated MLPs: HF's gate and up projections are one [gate; up] matrix in megatron-core (each
  expert's of a mixture-of-experts layer too, its router `mlp.gate` megatron-core's `mlp.router`);
- class token and position embeddings lose their leading batch dimensions.

torch is imported only where a tensor is converted, so the registry (read by the planner, which
never loads torch) can name each family's rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_omnibal.models.families.shared.config import HFModel
from megatron_omnibal.models.spec import VisionSpec

if TYPE_CHECKING:
    import torch

Convert = Callable[[list["torch.Tensor"]], "torch.Tensor"]
Split = Callable[["torch.Tensor"], list["torch.Tensor"]]


@dataclass(frozen=True)
class Rule:
    """One canonical tensor and the HF tensors it is made of."""

    canonical: str
    hf: tuple[str, ...]
    to_canonical: Convert = field(default=lambda ts: ts[0], compare=False)
    to_hf: Split = field(default=lambda t: [t], compare=False)


def qkv_fuse(heads: int, groups: int, dim: int) -> Convert:
    """q [heads*d, ...], k, v [groups*d, ...] -> [groups, (heads/groups + 2) * d, ...]."""

    def fuse(ts: list[torch.Tensor]) -> torch.Tensor:
        import torch

        q, k, v = ts
        rest = q.shape[1:]
        q = q.reshape(groups, heads // groups * dim, *rest)
        k, v = (t.reshape(groups, dim, *rest) for t in (k, v))
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    return fuse


def qkv_split(heads: int, groups: int, dim: int) -> Split:
    """Inverse of qkv_fuse."""

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        rest = t.shape[1:]
        per = heads // groups * dim
        g = t.reshape(groups, per + 2 * dim, *rest)
        q, k, v = g[:, :per], g[:, per : per + dim], g[:, per + dim :]
        return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]

    return split


def chunks_fuse(fuse: Convert) -> Convert:
    """[Q_all; K_all; V_all] as one tensor -> fused per group."""
    return lambda ts: fuse(list(ts[0].chunk(3, dim=0)))


def chunks_split(split: Split) -> Split:
    return lambda t: [cat(split(t))]


def cat(ts: list[torch.Tensor]) -> torch.Tensor:
    import torch

    return torch.cat(ts, dim=0)


def halves(t: torch.Tensor) -> list[torch.Tensor]:
    return [x.contiguous() for x in t.chunk(2, dim=0)]


def reshape(canonical: tuple[int, ...], hf: tuple[int, ...]) -> tuple[Convert, Split]:
    return (lambda ts: ts[0].reshape(canonical)), (lambda t: [t.reshape(hf)])


def layer_rules(
    prefix: str, i: int, names: dict[str, tuple[str, ...]], attn: tuple[Convert, Split] | None
) -> list[Rule]:
    """Rules of one transformer layer: `names` maps canonical suffixes to HF suffixes."""
    out = []
    for suffix, hf in names.items():
        hf_full = tuple(h.format(i=i) for h in hf)
        canonical = f"{prefix}.layers.{i}.{suffix}"
        if suffix.startswith("self_attention.linear_qkv") and attn is not None:
            out.append(Rule(canonical, hf_full, *attn))
        elif suffix.startswith("mlp.linear_fc1") and len(hf) == 2:
            out.append(Rule(canonical, hf_full, cat, halves))
        else:
            out.append(Rule(canonical, hf_full))
    return out


def norm(prefix: str, hf: str, bias: bool) -> dict[str, tuple[str, ...]]:
    out = {f"{prefix}.weight": (f"{hf}.weight",)}
    if bias:
        out[f"{prefix}.bias"] = (f"{hf}.bias",)
    return out


def linear(prefix: str, hf: tuple[str, ...], bias: bool) -> dict[str, tuple[str, ...]]:
    out = {f"{prefix}.weight": tuple(f"{h}.weight" for h in hf)}
    if bias:
        out[f"{prefix}.bias"] = tuple(f"{h}.bias" for h in hf)
    return out


def language_rules(
    model: HFModel, experts: Callable[[int, HFModel], list[Rule]] | None = None
) -> list[Rule]:
    """The LLM's rules; a mixture-of-experts layer's router and experts by `experts(i, model)`
    (default: one tensor per expert, Qwen3-MoE's)."""
    experts = experts or per_expert_rules
    llm = model.spec.llm
    internlm2 = model.llm_arch == "internlm2"
    base = "language_model.model"
    if internlm2:
        layer = f"{base}.layers.{{i}}"
        names = {
            "input_layernorm.weight": (f"{layer}.attention_norm.weight",),
            "self_attention.linear_qkv.weight": (f"{layer}.attention.wqkv.weight",),
            "self_attention.linear_proj.weight": (f"{layer}.attention.wo.weight",),
            "pre_mlp_layernorm.weight": (f"{layer}.ffn_norm.weight",),
            "mlp.linear_fc1.weight": (
                f"{layer}.feed_forward.w1.weight",
                f"{layer}.feed_forward.w3.weight",
            ),
            "mlp.linear_fc2.weight": (f"{layer}.feed_forward.w2.weight",),
        }
        attn = None  # wqkv is already megatron-core's per-group layout
        embed, head = f"{base}.tok_embeddings.weight", "language_model.output.weight"
    else:
        layer = f"{base}.layers.{{i}}"
        a = f"{layer}.self_attn"
        names = {
            "input_layernorm.weight": (f"{layer}.input_layernorm.weight",),
            **linear(
                "self_attention.linear_qkv", (f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"),
                llm.qkv_bias,
            ),
            "self_attention.linear_proj.weight": (f"{a}.o_proj.weight",),
            "pre_mlp_layernorm.weight": (f"{layer}.post_attention_layernorm.weight",),
            "mlp.linear_fc1.weight": (
                f"{layer}.mlp.gate_proj.weight",
                f"{layer}.mlp.up_proj.weight",
            ),
            "mlp.linear_fc2.weight": (f"{layer}.mlp.down_proj.weight",),
        }  # fmt: skip
        if llm.qk_norm:  # Qwen3: one per-head weight each, replicated over TP
            names["self_attention.q_layernorm.weight"] = (f"{a}.q_norm.weight",)
            names["self_attention.k_layernorm.weight"] = (f"{a}.k_norm.weight",)
        qkv = (llm.num_attention_heads, llm.num_query_groups, llm.kv_channels)
        attn = (qkv_fuse(*qkv), qkv_split(*qkv))
        embed, head = f"{base}.embed_tokens.weight", "language_model.lm_head.weight"
    if llm.is_moe:
        names = {k: v for k, v in names.items() if not k.startswith("mlp.")}
    rules = [Rule("embedding.word_embeddings.weight", (embed,))]
    for i in range(llm.num_layers):
        rules += layer_rules("llm", i, names, attn)
        if llm.is_moe:
            rules += experts(i, model)
    rules.append(Rule("llm.final_layernorm.weight", (f"{base}.norm.weight",)))
    if not llm.tie_embeddings:
        rules.append(Rule("output_layer.weight", (head,)))
    return rules




EXPERT = "llm.layers.{i}.mlp.experts.local_experts.{e}"


def per_expert_rules(i: int, model: HFModel) -> list[Rule]:
    """Layer `i`'s router and experts, Qwen3-MoE's one tensor per expert: the router
    `mlp.gate` is megatron-core's `mlp.router`; expert e's gate and up projections are its
    [gate; up] fc1 and its down projection its fc2 (global expert indices: the EP split is the
    checkpoint's business)."""
    hf = f"language_model.model.layers.{i}.mlp"
    rules = [Rule(f"llm.layers.{i}.mlp.router.weight", (f"{hf}.gate.weight",))]
    for e in range(model.spec.llm.num_experts):
        ours, theirs = EXPERT.format(i=i, e=e), f"{hf}.experts.{e}"
        rules.append(Rule(f"{ours}.linear_fc1.weight",
                          (f"{theirs}.gate_proj.weight", f"{theirs}.up_proj.weight"), cat, halves))
        rules.append(Rule(f"{ours}.linear_fc2.weight", (f"{theirs}.down_proj.weight",)))
    return rules


def sliced(name: str, index: int) -> str:
    """The HF name of slice `index` (along the first axis) of tensor `name`: a rule's part of
    a tensor several rules share (fused experts). models.hf_weights reads and writes it."""
    return f"{name}[{index}]"


def oriented(shape: tuple[int, int]) -> Convert:
    """A fused expert's slice as the canonical [out, in] `shape`: the hub stores it [in, out]
    (transposed), a checkpoint transformers 5 wrote [out, in]; told apart by shape (a square
    slice is taken as the hub's)."""

    def convert(ts: list[torch.Tensor]) -> torch.Tensor:
        t = ts[0]
        return t.T.contiguous() if tuple(t.shape) == shape[::-1] else t

    return convert


def transposed(t: torch.Tensor) -> list[torch.Tensor]:
    """A canonical [out, in] expert weight as the hub's [in, out] slice."""
    return [t.T.contiguous()]


def fused_expert_rules(i: int, model: HFModel) -> list[Rule]:
    """Layer `i`'s router and experts, Qwen3-VL-MoE's fused tensors: expert e is slice e of
    `mlp.experts.gate_up_proj` (the hub's [E, H, 2I]: its [gate | up] fc1 transposed) and of
    `mlp.experts.down_proj` ([E, I, H]: its fc2 transposed). Both orientations are read (see
    `oriented`); the hub's is written."""
    llm = model.spec.llm
    H, f = llm.hidden_size, llm.moe_ffn_hidden_size
    hf = f"language_model.model.layers.{i}.mlp"
    rules = [Rule(f"llm.layers.{i}.mlp.router.weight", (f"{hf}.gate.weight",))]
    for e in range(llm.num_experts):
        ours = EXPERT.format(i=i, e=e)
        rules.append(Rule(f"{ours}.linear_fc1.weight",
                          (sliced(f"{hf}.experts.gate_up_proj", e),), oriented((2 * f, H)),
                          transposed))  # fmt: skip
        rules.append(Rule(f"{ours}.linear_fc2.weight", (sliced(f"{hf}.experts.down_proj", e),),
                          oriented((H, f)), transposed))  # fmt: skip
    return rules


def projector_rules(model: HFModel, norm_name: str, fc1: str, fc2: str) -> list[Rule]:
    """The projector's rules: its MLP's two linear layers under the family's HF names `fc1`,
    `fc2`, and the norm `norm_name` of a pixel-shuffle MLP or a patch merger."""
    p = model.spec.projector
    names: dict[str, tuple[str, ...]] = {
        **linear("projector.mlp.linear_fc1", (fc1,), p.bias),
        **linear("projector.mlp.linear_fc2", (fc2,), p.bias),
    }
    if p.type in ("pixel_shuffle_mlp", "patch_merger"):
        names.update(norm("projector.norm", norm_name, p.type == "pixel_shuffle_mlp"))
    return [Rule(c, h) for c, h in names.items()]


def transformers_projector_rules(model: HFModel) -> list[Rule]:
    """The projector of transformers' own VLM classes (InternVL, LLaVA): `multi_modal_projector`
    with `layer_norm`, `linear_1`, `linear_2`."""
    return projector_rules(model, "multi_modal_projector.layer_norm",
                           "multi_modal_projector.linear_1", "multi_modal_projector.linear_2")


def tiled_patch_shapes(v: VisionSpec) -> dict[str, tuple[int, ...]]:
    """Canonical shapes of a tiled tower's patch embedding: a 2-D convolution and a learned
    table of one tile's positions."""
    return {
        "patch_embed.conv.weight": (v.hidden_size, 3, v.patch_size, v.patch_size),
        "patch_embed.position_embeddings": (v.seq_per_tile, v.hidden_size),
    }


def layers_past_feature(pattern: re.Pattern[str], name: str, v: VisionSpec) -> bool:
    """Whether `name` belongs to a ViT layer past the feature layer (never used): `pattern`
    captures a layer index as its group 1."""
    m = pattern.match(name)
    return bool(m) and int(m.group(1)) >= v.num_layers
