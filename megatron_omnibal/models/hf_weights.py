"""Hugging Face checkpoint tensors <-> the stage module's model-wide ("canonical") tensors.

Canonical names are the Megatron stage module's parameter names with GLOBAL layer indices at
TP = 1 (megatron.model.global_name), e.g. `vit.layers.3.self_attention.linear_qkv.weight`; their
tensors are whole (no TP split, no vocabulary or head padding). Each `Rule` ties one canonical
tensor to the HF tensors it is made of and converts both ways (q, k, v fused per KV group,
gated MLPs' [gate; up], tables without their batch dimensions). Where several canonical tensors
share one HF tensor (Qwen3-VL-MoE's fused experts) a rule names its slice, `name[i]` (slice i
along the first axis): read alone from the file, written in place by the exporter.

Key styles: transformers 5 saves `language_model.model.*` / `vision_tower.*`, checkpoints made by
transformers 4.5x say `model.language_model.*` / `lm_head.*`, Qwen2.5-VL's hub checkpoints
`model.layers.*` / `visual.*`; the reader maps the file's own style onto one and the exporter
writes the style of the checkpoint it mirrors.

Each family's rules are in its folder (models/families/<family>/weights.py), found through the
registry; the conversions and the LLM's rules they share are models/families/shared/weights.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from megatron_omnibal.models.families.family import KeyStyle
from megatron_omnibal.models.families.registry import family_named, family_of
from megatron_omnibal.models.families.shared.weights import Rule, language_rules
from megatron_omnibal.models.hf_config import HFModel
from megatron_omnibal.models.spec import ModelSpec


class WeightsError(ValueError):
    """A checkpoint whose tensors do not match the model; the message names file and tensor."""


def rules_for(model: HFModel) -> list[Rule]:
    """Every canonical tensor of the model with its HF tensors (HF names in the
    `language_model.model.*` / `vision_tower.*` style): the family's vision and projector
    rules, then the LLM's."""
    family = family_of(model)
    return (family.vision_rules(model) + family.projector_rules(model)
            + language_rules(model, family.expert_rules))  # fmt: skip


# Where a checkpoint may store its tied output head (transformers ties it again on load).
TIED_HEAD_COPIES = ("language_model.lm_head.weight", "language_model.output.weight")


def unused_hf_names(model: HFModel, names: set[str]) -> set[str]:
    """HF tensors the model legitimately never uses: those its family names (ViT layers past
    the feature layer, CLIP's post-LayerNorm, a final norm the spec does not run) and a tied
    head's stored copy."""
    unused = family_of(model).unused
    tied = model.spec.llm.tie_embeddings
    return {n for n in names if unused(model, n) or (tied and n in TIED_HEAD_COPIES)}


def detect_style(names: set[str], family: str) -> KeyStyle:
    """How a checkpoint's names differ from `rules_for`'s: transformers 4.5x-made checkpoints
    say `model.language_model.*` and `lm_head.*`; the family adds its own (transformers 5 saves
    LLaVA's CLIP tower without its inner `vision_model.`; Qwen2.5-VL's hub checkpoints say
    `model.layers.*`, `visual.*` and `lm_head.*`)."""
    style: list[tuple[str, str]] = []
    transformers_4 = any(n.startswith("model.language_model.") for n in names)
    if transformers_4:
        style += [
            ("model.language_model.", "language_model.model."),
            ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."),
            ("model.visual.", "visual."),
            ("lm_head.", "language_model.lm_head."),
        ]
    style += family_named(family).key_style(names, transformers_4)
    return tuple(style)


def split_slice(name: str) -> tuple[str, int | None]:
    """`x[3]` -> (`x`, 3): a rule's slice of a tensor several rules share (weights.sliced);
    a plain name -> (name, None)."""
    if name.endswith("]") and "[" in name:
        base, index = name[:-1].rsplit("[", 1)
        return base, int(index)
    return name, None


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
        """The tensor `name` (rule style), read from its shard; `x[i]` reads slice i of x
        alone."""
        from safetensors import safe_open

        name, index = split_slice(name)
        file_name = to_file_name(name, self.style)
        if file_name not in self.files:
            raise WeightsError(f"{self.path}: no tensor '{file_name}' in the checkpoint")
        shard = self.files[file_name]
        if shard not in self._open:
            self._open.clear()  # one shard open at a time
            self._open[shard] = safe_open(shard, "pt")
        if index is not None:
            return self._open[shard].get_slice(file_name)[index]  # type: ignore[attr-defined]
        return self._open[shard].get_tensor(file_name)  # type: ignore[attr-defined]

    def shard_of(self, name: str) -> Path:
        return self.files[to_file_name(split_slice(name)[0], self.style)]


def check_coverage(model: HFModel, rules: list[Rule], names: set[str], where: Path) -> None:
    """Every tensor the rules need is there and every tensor there is used or known unused."""
    needed = {split_slice(n)[0] for r in rules for n in r.hf}
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
    return spec_shapes(model.spec, family_of(model).patch_shapes(model.spec.vit))


def spec_shapes(
    s: ModelSpec, patch: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """canonical_shapes of spec `s` whose patch embedding's own tensors are `patch`."""
    v, p, llm = s.vit, s.projector, s.llm
    h = v.hidden_size
    out = dict(patch)
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
        if p.merger_norm == "layernorm":
            out["projector.norm.bias"] = (h,)
    mergers = ["projector"] + [f"deepstack_mergers.{k}" for k in range(len(v.deepstack_indexes))]
    for merger in mergers:  # the DeepStack mergers: LayerNorm over the group, then the MLP
        if merger != "projector":
            out[f"{merger}.norm.weight"] = out[f"{merger}.norm.bias"] = (s.projector_in,)
        out[f"{merger}.mlp.linear_fc1.weight"] = (p.hidden_size, s.projector_in)
        out[f"{merger}.mlp.linear_fc2.weight"] = (llm.hidden_size, p.hidden_size)
        if p.bias:
            out[f"{merger}.mlp.linear_fc1.bias"] = (p.hidden_size,)
            out[f"{merger}.mlp.linear_fc2.bias"] = (llm.hidden_size,)
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
        if llm.is_moe:  # the router and each expert in place of the dense MLP
            del layer["mlp.linear_fc1.weight"], layer["mlp.linear_fc2.weight"]
            layer["mlp.router.weight"] = (llm.num_experts, H)
            f = llm.moe_ffn_hidden_size
            for e in range(llm.num_experts):
                expert = f"mlp.experts.local_experts.{e}."
                layer[expert + "linear_fc1.weight"] = ((2 if llm.gated_mlp else 1) * f, H)
                layer[expert + "linear_fc2.weight"] = (H, f)
        out.update({pre + k: shape for k, shape in layer.items()})
    out["llm.final_layernorm.weight"] = (H,)
    if not llm.tie_embeddings:
        out["output_layer.weight"] = (llm.vocab_size, H)
    return out
