"""Hugging Face checkpoint tensors <-> the stage module's model-wide ("canonical") tensors.

Canonical names are the Megatron stage module's parameter names with GLOBAL layer indices at
TP = 1 (megatron.model.global_name), e.g. `vit.layers.3.self_attention.linear_qkv.weight`; their
tensors are whole (no TP split, no vocabulary or head padding). Each `Rule` ties one canonical
tensor to the HF tensors it is made of and converts both ways:

- attention: HF keeps q, k, v apart (transformers), or fused as [Q_all; K_all; V_all]
  (OpenGVLab's InternViT); megatron-core fuses them per KV group as [q heads of the group, k, v]
  (InternLM2's `wqkv` already is that layout);
- gated MLPs: HF's gate and up projections are one [gate; up] matrix in megatron-core;
- class token and position embeddings lose their leading batch dimensions.

Key styles: transformers 5 saves `language_model.model.*` / `vision_tower.*`, checkpoints made by
transformers 4.5x say `model.language_model.*` / `lm_head.*`, Qwen2.5-VL's hub checkpoints
`model.layers.*` / `visual.*`; the reader maps the file's own style onto one and the exporter
writes the style of the checkpoint it mirrors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_omnibal.models.hf_config import HFModel
from megatron_omnibal.models.spec import VisionSpec

Convert = Callable[[list[torch.Tensor]], torch.Tensor]
Split = Callable[[torch.Tensor], list[torch.Tensor]]


class WeightsError(ValueError):
    """A checkpoint whose tensors do not match the model; the message names file and tensor."""


@dataclass(frozen=True)
class Rule:
    """One canonical tensor and the HF tensors it is made of."""

    canonical: str
    hf: tuple[str, ...]
    to_canonical: Convert = field(default=lambda ts: ts[0], compare=False)
    to_hf: Split = field(default=lambda t: [t], compare=False)


def _qkv_fuse(heads: int, groups: int, dim: int) -> Convert:
    """q [heads*d, ...], k, v [groups*d, ...] -> [groups, (heads/groups + 2) * d, ...]."""

    def fuse(ts: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = ts
        rest = q.shape[1:]
        q = q.reshape(groups, heads // groups * dim, *rest)
        k, v = (t.reshape(groups, dim, *rest) for t in (k, v))
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    return fuse


def _qkv_split(heads: int, groups: int, dim: int) -> Split:
    """Inverse of _qkv_fuse."""

    def split(t: torch.Tensor) -> list[torch.Tensor]:
        rest = t.shape[1:]
        per = heads // groups * dim
        g = t.reshape(groups, per + 2 * dim, *rest)
        q, k, v = g[:, :per], g[:, per : per + dim], g[:, per + dim :]
        return [x.reshape(-1, *rest).contiguous() for x in (q, k, v)]

    return split


def _chunks_fuse(fuse: Convert) -> Convert:
    """[Q_all; K_all; V_all] as one tensor -> fused per group."""
    return lambda ts: fuse(list(ts[0].chunk(3, dim=0)))


def _chunks_split(split: Split) -> Split:
    return lambda t: [torch.cat(split(t), dim=0)]


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(ts, dim=0)


def _halves(t: torch.Tensor) -> list[torch.Tensor]:
    return [x.contiguous() for x in t.chunk(2, dim=0)]


def _reshape(canonical: tuple[int, ...], hf: tuple[int, ...]) -> tuple[Convert, Split]:
    return (lambda ts: ts[0].reshape(canonical)), (lambda t: [t.reshape(hf)])


def _layer_rules(
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
            out.append(Rule(canonical, hf_full, _cat, _halves))
        else:
            out.append(Rule(canonical, hf_full))
    return out


def _norm(prefix: str, hf: str, bias: bool) -> dict[str, tuple[str, ...]]:
    out = {f"{prefix}.weight": (f"{hf}.weight",)}
    if bias:
        out[f"{prefix}.bias"] = (f"{hf}.bias",)
    return out


def _linear(prefix: str, hf: tuple[str, ...], bias: bool) -> dict[str, tuple[str, ...]]:
    out = {f"{prefix}.weight": tuple(f"{h}.weight" for h in hf)}
    if bias:
        out[f"{prefix}.bias"] = tuple(f"{h}.bias" for h in hf)
    return out


def _qwen_vision_rules(model: HFModel) -> list[Rule]:
    """Qwen2.5-VL's tower: Conv3d patch embedding, fused qkv [Q_all; K_all; V_all] with bias,
    SwiGLU with biases, RMSNorms, and its merger as the projector."""
    v = model.spec.vit
    heads, layer = v.num_attention_heads, "visual.blocks.{i}"
    fuse, split = _qkv_fuse(heads, heads, v.head_dim), _qkv_split(heads, heads, v.head_dim)
    names = {
        **_norm("input_layernorm", f"{layer}.norm1", False),
        **_linear("self_attention.linear_qkv", (f"{layer}.attn.qkv",), True),
        **_linear("self_attention.linear_proj", (f"{layer}.attn.proj",), True),
        **_norm("pre_mlp_layernorm", f"{layer}.norm2", False),
        **_linear("mlp.linear_fc1", (f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj"), True),
        **_linear("mlp.linear_fc2", (f"{layer}.mlp.down_proj",), True),
    }
    rules = [Rule("patch_embed.conv.weight", ("visual.patch_embed.proj.weight",))]
    for i in range(v.num_layers):
        rules += _layer_rules("vit", i, names, (_chunks_fuse(fuse), _chunks_split(split)))
    return rules


def _patch_embedding_rules(v: VisionSpec, cls: str, positions: str, conv: str) -> list[Rule]:
    """An InternViT tower's patch embedding under its HF names: class token, position table,
    convolution."""
    h, seq = v.hidden_size, v.seq_per_tile
    return [
        Rule("patch_embed.class_token", (cls,), *_reshape((1, h), (1, 1, h))),
        Rule("patch_embed.position_embeddings", (positions,), *_reshape((seq, h), (1, seq, h))),
        Rule("patch_embed.conv.weight", (f"{conv}.weight",)),
        Rule("patch_embed.conv.bias", (f"{conv}.bias",)),
    ]


def _vision_rules(model: HFModel) -> list[Rule]:
    spec, fam = model.spec, model.family
    if fam == "qwen2_5_vl":
        return _qwen_vision_rules(model)
    v = spec.vit
    ln = v.norm == "layernorm"
    h = v.hidden_size
    heads = v.num_attention_heads
    fuse, split = _qkv_fuse(heads, heads, v.head_dim), _qkv_split(heads, heads, v.head_dim)
    rules: list[Rule] = []
    if fam == "internvl":
        emb = "vision_tower.embeddings"
        layer = "vision_tower.encoder.layer.{i}"
        conv = f"{emb}.patch_embeddings.projection"
        rules += _patch_embedding_rules(v, f"{emb}.cls_token", f"{emb}.position_embeddings", conv)
        a = f"{layer}.attention"
        names = {
            **_norm("input_layernorm", f"{layer}.layernorm_before", ln),
            **_linear("self_attention.linear_qkv", (f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"),
                      v.qkv_bias),
            **_linear("self_attention.linear_proj", (f"{a}.projection_layer",), True),
            **_norm("pre_mlp_layernorm", f"{layer}.layernorm_after", ln),
            **_linear("mlp.linear_fc1", (f"{layer}.mlp.fc1",), True),
            **_linear("mlp.linear_fc2", (f"{layer}.mlp.fc2",), True),
            "self_attn_bda.weight": (f"{layer}.lambda_1",),
            "mlp_bda.weight": (f"{layer}.lambda_2",),
        }  # fmt: skip
        if v.qk_norm:
            names["self_attention.q_layernorm.weight"] = (f"{a}.q_norm.weight",)
            names["self_attention.k_layernorm.weight"] = (f"{a}.k_norm.weight",)
        attn = (fuse, split)
        if v.post_norm:
            rules += [
                Rule("vit_final_norm.weight", ("vision_tower.layernorm.weight",)),
                Rule("vit_final_norm.bias", ("vision_tower.layernorm.bias",)),
            ]
    elif fam == "internvl_chat":
        emb = "vision_model.embeddings"
        layer = "vision_model.encoder.layers.{i}"
        rules += _patch_embedding_rules(
            v, f"{emb}.class_embedding", f"{emb}.position_embedding", f"{emb}.patch_embedding"
        )
        a = f"{layer}.attn"
        names = {
            **_norm("input_layernorm", f"{layer}.norm1", ln),
            **_linear("self_attention.linear_qkv", (f"{a}.qkv",), v.qkv_bias),
            **_linear("self_attention.linear_proj", (f"{a}.proj",), True),
            **_norm("pre_mlp_layernorm", f"{layer}.norm2", ln),
            **_linear("mlp.linear_fc1", (f"{layer}.mlp.fc1",), True),
            **_linear("mlp.linear_fc2", (f"{layer}.mlp.fc2",), True),
            "self_attn_bda.weight": (f"{layer}.ls1",),
            "mlp_bda.weight": (f"{layer}.ls2",),
        }
        if v.qk_norm:
            names["self_attention.q_layernorm.weight"] = (f"{a}.q_norm.weight",)
            names["self_attention.k_layernorm.weight"] = (f"{a}.k_norm.weight",)
        attn = (_chunks_fuse(fuse), _chunks_split(split))
    else:  # llava: CLIP
        emb = "vision_tower.vision_model.embeddings"
        layer = "vision_tower.vision_model.encoder.layers.{i}"
        pre = "vision_tower.vision_model.pre_layrnorm"
        rules += [
            Rule("patch_embed.class_token", (f"{emb}.class_embedding",), *_reshape((1, h), (h,))),
            Rule("patch_embed.position_embeddings", (f"{emb}.position_embedding.weight",)),
            Rule("patch_embed.conv.weight", (f"{emb}.patch_embedding.weight",)),
            Rule("patch_embed.pre_norm.weight", (f"{pre}.weight",)),
            Rule("patch_embed.pre_norm.bias", (f"{pre}.bias",)),
        ]
        a = f"{layer}.self_attn"
        names = {
            **_norm("input_layernorm", f"{layer}.layer_norm1", True),
            **_linear("self_attention.linear_qkv", (f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"),
                      True),
            **_linear("self_attention.linear_proj", (f"{a}.out_proj",), True),
            **_norm("pre_mlp_layernorm", f"{layer}.layer_norm2", True),
            **_linear("mlp.linear_fc1", (f"{layer}.mlp.fc1",), True),
            **_linear("mlp.linear_fc2", (f"{layer}.mlp.fc2",), True),
        }  # fmt: skip
        attn = (fuse, split)
    for i in range(v.num_layers):
        rules += _layer_rules("vit", i, names, attn)
    return rules


def _projector_rules(model: HFModel) -> list[Rule]:
    p = model.spec.projector
    if model.family == "internvl_chat":
        hf = {"norm": "mlp1.0", "fc1": "mlp1.1", "fc2": "mlp1.3"}
    elif model.family == "qwen2_5_vl":
        hf = {"norm": "visual.merger.ln_q", "fc1": "visual.merger.mlp.0",
              "fc2": "visual.merger.mlp.2"}  # fmt: skip
    else:
        hf = {
            "norm": "multi_modal_projector.layer_norm",
            "fc1": "multi_modal_projector.linear_1",
            "fc2": "multi_modal_projector.linear_2",
        }
    names: dict[str, tuple[str, ...]] = {
        **_linear("projector.mlp.linear_fc1", (hf["fc1"],), p.bias),
        **_linear("projector.mlp.linear_fc2", (hf["fc2"],), p.bias),
    }
    if p.type in ("pixel_shuffle_mlp", "patch_merger"):
        names.update(_norm("projector.norm", hf["norm"], p.type == "pixel_shuffle_mlp"))
    return [Rule(c, h) for c, h in names.items()]


def _language_rules(model: HFModel) -> list[Rule]:
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
            **_linear(
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
        attn = (_qkv_fuse(*qkv), _qkv_split(*qkv))
        embed, head = f"{base}.embed_tokens.weight", "language_model.lm_head.weight"
    rules = [Rule("embedding.word_embeddings.weight", (embed,))]
    for i in range(llm.num_layers):
        rules += _layer_rules("llm", i, names, attn)
    rules.append(Rule("llm.final_layernorm.weight", (f"{base}.norm.weight",)))
    if not llm.tie_embeddings:
        rules.append(Rule("output_layer.weight", (head,)))
    return rules


def rules_for(model: HFModel) -> list[Rule]:
    """Every canonical tensor of the model with its HF tensors (HF names in the
    `language_model.model.*` / `vision_tower.*` style)."""
    return _vision_rules(model) + _projector_rules(model) + _language_rules(model)


# Where a checkpoint may store its tied output head (transformers ties it again on load).
TIED_HEAD_COPIES = ("language_model.lm_head.weight", "language_model.output.weight")


def unused_hf_names(model: HFModel, names: set[str]) -> set[str]:
    """HF tensors the model legitimately never uses: ViT layers past the feature layer,
    CLIP's post-LayerNorm (only on its pooled output), a tied head's stored copy."""
    v = model.spec.vit
    pattern = re.compile(
        r"^(vision_tower\.vision_model\.encoder\.layers|vision_tower\.encoder\.layer|"
        r"vision_model\.encoder\.layers)\.(\d+)\."
    )
    head_norm = ("vision_tower.layernorm.weight", "vision_tower.layernorm.bias")
    out = set()
    for n in names:
        m = pattern.match(n)
        past_feature_layer = bool(m) and int(m.group(2)) >= v.num_layers
        clip_post_norm = n.startswith("vision_tower.vision_model.post_layernorm.")
        tied_copy = model.spec.llm.tie_embeddings and n in TIED_HEAD_COPIES
        unused_norm = n in head_norm and not v.post_norm
        if past_feature_layer or clip_post_norm or tied_copy or unused_norm:
            out.add(n)
    return out


KeyStyle = tuple[tuple[str, str], ...]  # (file prefix, rule prefix), applied in order


def detect_style(names: set[str], family: str) -> KeyStyle:
    """How a checkpoint's names differ from `rules_for`'s: transformers 4.5x-made checkpoints
    say `model.language_model.*` and `lm_head.*`; transformers 5 saves LLaVA's CLIP tower
    without its inner `vision_model.`; Qwen2.5-VL's hub checkpoints (and transformers 5's)
    say `model.layers.*`, `visual.*` and `lm_head.*`."""
    style: list[tuple[str, str]] = []
    if any(n.startswith("model.language_model.") for n in names):
        style += [
            ("model.language_model.", "language_model.model."),
            ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("model.visual.", "visual."),
            ("lm_head.", "language_model.lm_head."),
        ]
    elif family == "qwen2_5_vl":
        style += [("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")]
    if family == "llava" and not any(".vision_model." in f".{n}" for n in names):
        style.append(("vision_tower.", "vision_tower.vision_model."))
    return tuple(style)


def to_rule_name(name: str, style: KeyStyle) -> str:
    for file_prefix, rule_prefix in style:
        if name.startswith(file_prefix):
            name = rule_prefix + name[len(file_prefix) :]
    return name


def to_file_name(name: str, style: KeyStyle) -> str:
    for file_prefix, rule_prefix in reversed(style):
        if name.startswith(rule_prefix):
            name = file_prefix + name[len(rule_prefix) :]
    return name


class SafetensorsReader:
    """Tensors of an HF checkpoint directory, read one at a time (a 26B checkpoint is never
    in memory at once). Errors name the shard file and the tensor."""

    def __init__(self, model: HFModel) -> None:
        import json

        from safetensors import safe_open

        self.path = model.path
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (KeyError, ValueError) as exc:
                raise WeightsError(f"{index}: not a safetensors index ({exc})") from exc
            files = {n: self.path / f for n, f in weight_map.items()}
        elif single.is_file():
            with safe_open(single, "pt") as f:
                files = {n: single for n in f.keys()}  # noqa: SIM118 - safe_open is no dict
        else:
            found = sorted(p.name for p in self.path.glob("*.bin"))
            hint = f" (found {', '.join(found)}: convert them to safetensors)" if found else ""
            raise WeightsError(f"{self.path}: no model.safetensors or index{hint}")
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise WeightsError(f"{shard}: shard listed in the index is missing")
        self.files = files
        self.style = detect_style(set(files), model.family)
        self._open: dict[Path, object] = {}

    def names(self) -> set[str]:
        """Tensor names in the style of `rules_for`."""
        return {to_rule_name(n, self.style) for n in self.files}

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` (rule style), read from its shard."""
        from safetensors import safe_open

        file_name = to_file_name(name, self.style)
        if file_name not in self.files:
            raise WeightsError(f"{self.path}: no tensor '{file_name}' in the checkpoint")
        shard = self.files[file_name]
        if shard not in self._open:
            self._open.clear()  # one shard open at a time
            self._open[shard] = safe_open(shard, "pt")
        return self._open[shard].get_tensor(file_name)  # type: ignore[attr-defined]

    def shard_of(self, name: str) -> Path:
        return self.files[to_file_name(name, self.style)]


def check_coverage(model: HFModel, rules: list[Rule], names: set[str], where: Path) -> None:
    """Every tensor the rules need is there and every tensor there is used or known unused."""
    needed = {n for r in rules for n in r.hf}
    missing = sorted(needed - names)
    if missing:
        raise WeightsError(
            f"{where}: {len(missing)} tensor(s) the model needs are missing, e.g. '{missing[0]}'"
        )
    extra = sorted(names - needed - unused_hf_names(model, names))
    if extra:
        raise WeightsError(
            f"{where}: {len(extra)} tensor(s) this architecture does not use, e.g. '{extra[0]}' "
            "(is config.json the checkpoint's own?)"
        )


def canonical_tensors(
    model: HFModel, reader: SafetensorsReader, wanted: Callable[[str], bool] = lambda n: True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) for every canonical tensor `wanted` accepts, in rule order,
    each made from its HF tensors as they are read (shapes checked against the spec)."""
    rules = rules_for(model)
    check_coverage(model, rules, reader.names(), reader.path)
    shapes = canonical_shapes(model)
    for rule in rules:
        if not wanted(rule.canonical):
            continue
        parts = [reader.get(n) for n in rule.hf]
        try:
            tensor = rule.to_canonical(parts)
        except RuntimeError as exc:
            raise WeightsError(
                f"{reader.shard_of(rule.hf[0])}: tensor(s) {', '.join(rule.hf)} with shape(s) "
                f"{[tuple(p.shape) for p in parts]} do not fit {rule.canonical}: {exc}"
            ) from exc
        if tuple(tensor.shape) != shapes[rule.canonical]:
            raise WeightsError(
                f"{reader.shard_of(rule.hf[0])}: tensor(s) {', '.join(rule.hf)} give "
                f"{rule.canonical} of shape {tuple(tensor.shape)}, the model has "
                f"{shapes[rule.canonical]}"
            )
        yield rule.canonical, tensor


def canonical_shapes(model: HFModel) -> dict[str, tuple[int, ...]]:
    """The shape of every canonical tensor, from the spec alone."""
    s = model.spec
    v, p, llm = s.vit, s.projector, s.llm
    h = v.hidden_size
    if v.native_resolution:
        kernel = (v.temporal_patch_size, v.patch_size, v.patch_size)
        out: dict[str, tuple[int, ...]] = {"patch_embed.conv.weight": (h, 3, *kernel)}
    else:
        out = {
            "patch_embed.conv.weight": (h, 3, v.patch_size, v.patch_size),
            "patch_embed.position_embeddings": (v.seq_per_tile, h),
        }
    if v.patch_bias:
        out["patch_embed.conv.bias"] = (h,)
    if v.class_token:
        out["patch_embed.class_token"] = (1, h)
    if v.pre_norm:
        out["patch_embed.pre_norm.weight"] = out["patch_embed.pre_norm.bias"] = (h,)
    norm_bias = v.norm == "layernorm"
    for i in range(v.num_layers):
        pre = f"vit.layers.{i}."
        layer = {
            "input_layernorm.weight": (h,),
            "self_attention.linear_qkv.weight": (3 * h, h),
            "self_attention.linear_proj.weight": (h, h),
            "self_attention.linear_proj.bias": (h,),
            "pre_mlp_layernorm.weight": (h,),
            "mlp.linear_fc1.weight": ((2 if v.gated_mlp else 1) * v.ffn_hidden_size, h),
            "mlp.linear_fc1.bias": ((2 if v.gated_mlp else 1) * v.ffn_hidden_size,),
            "mlp.linear_fc2.weight": (h, v.ffn_hidden_size),
            "mlp.linear_fc2.bias": (h,),
        }
        if norm_bias:
            layer["input_layernorm.bias"] = layer["pre_mlp_layernorm.bias"] = (h,)
        if v.qkv_bias:
            layer["self_attention.linear_qkv.bias"] = (3 * h,)
        if v.qk_norm:
            layer["self_attention.q_layernorm.weight"] = (h,)
            layer["self_attention.k_layernorm.weight"] = (h,)
        if v.layer_scale:
            layer["self_attn_bda.weight"] = layer["mlp_bda.weight"] = (h,)
        out.update({pre + k: shape for k, shape in layer.items()})
    if v.post_norm:
        out["vit_final_norm.weight"] = out["vit_final_norm.bias"] = (h,)
    if p.type == "pixel_shuffle_mlp":
        out["projector.norm.weight"] = out["projector.norm.bias"] = (s.projector_in,)
    if p.type == "patch_merger":
        out["projector.norm.weight"] = (h,)
    out["projector.mlp.linear_fc1.weight"] = (p.hidden_size, s.projector_in)
    out["projector.mlp.linear_fc2.weight"] = (llm.hidden_size, p.hidden_size)
    if p.bias:
        out["projector.mlp.linear_fc1.bias"] = (p.hidden_size,)
        out["projector.mlp.linear_fc2.bias"] = (llm.hidden_size,)
    H = llm.hidden_size
    qkv = llm.q_size + 2 * llm.kv_size
    out["embedding.word_embeddings.weight"] = (llm.vocab_size, H)
    for i in range(llm.num_layers):
        pre = f"llm.layers.{i}."
        layer = {
            "input_layernorm.weight": (H,),
            "self_attention.linear_qkv.weight": (qkv, H),
            "self_attention.linear_proj.weight": (H, llm.q_size),
            "pre_mlp_layernorm.weight": (H,),
            "mlp.linear_fc1.weight": ((2 if llm.gated_mlp else 1) * llm.ffn_hidden_size, H),
            "mlp.linear_fc2.weight": (H, llm.ffn_hidden_size),
        }
        if llm.qkv_bias:
            layer["self_attention.linear_qkv.bias"] = (qkv,)
        if llm.qk_norm:
            layer["self_attention.q_layernorm.weight"] = (llm.kv_channels,)
            layer["self_attention.k_layernorm.weight"] = (llm.kv_channels,)
        out.update({pre + k: shape for k, shape in layer.items()})
    out["llm.final_layernorm.weight"] = (H,)
    if not llm.tie_embeddings:
        out["output_layer.weight"] = (llm.vocab_size, H)
    return out
