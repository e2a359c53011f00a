"""LoRA adapters of a checkpoint's canonical tensors -> a merged model, or a PEFT adapter.

Why both: a merged checkpoint (W + alpha / rank * B A) loads anywhere with no extra library;
a PEFT adapter directory is what teams share and stack on the base model. Both read the same
canonical tensors (`<linear>.weight`, `<linear>.lora_a` [rank, in], `<linear>.lora_b` [out, rank],
whole at TP = 1), so they hold the same function.

The PEFT adapter names HF modules: a fused canonical layer whose HF twin is several modules (the
LLM's q, k, v projections; a gated MLP's gate and up projections) gets its B split as the base
weight's rows split (rules of hf_weights: q, k, v out of megatron-core's per-KV-group order) and
its A copied to each: (B_q A) x is the q rows of (B A) x. Module names come from the model class
itself (built on the meta device), since transformers 5 loads checkpoint keys under other names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch

from megatron_omnibal.models.families.registry import family_of
from megatron_omnibal.models.hf_config import HFModel
from megatron_omnibal.models.hf_weights import WeightsError, rules_for, to_file_name
from megatron_omnibal.models.lora import LoraSpec, is_adapter, lora_layers, peft_refusal
from megatron_omnibal.models.spec import ModelSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"



def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  scale: float) -> torch.Tensor:  # fmt: skip
    """W + scale * B A, computed in fp32 and returned in W's dtype."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


def _split(name: str) -> tuple[str, str]:
    """(layer, part) of a canonical tensor of an adapted layer: part weight, lora_a, lora_b."""
    layer, _, part = name.rpartition(".")
    return layer, part


def merge_groups(
    groups: Iterable[Mapping[str, torch.Tensor]], spec: ModelSpec, lora: LoraSpec
) -> Iterator[dict[str, torch.Tensor]]:
    """The canonical groups with every adapted weight merged and the adapters dropped. A
    weight whose adapters arrive in a later group (torch_dist: a tensor per group) waits for
    them; raises WeightsError naming a layer whose weight or adapters never came."""
    adapted = set(lora_layers(spec, lora))
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for group in groups:
        out: dict[str, torch.Tensor] = {}
        for name, tensor in group.items():
            layer, part = _split(name)
            if layer not in adapted or part not in ("weight", "lora_a", "lora_b"):
                out[name] = tensor
                continue
            parts = pending.setdefault(layer, {})
            parts[part] = tensor
            if len(parts) == 3:
                out[f"{layer}.weight"] = merged_weight(
                    parts["weight"], parts["lora_a"], parts["lora_b"], lora.scale
                )
                del pending[layer]
        if out:
            yield out
    if pending:
        layer, parts = next(iter(pending.items()))
        missing = sorted({"weight", "lora_a", "lora_b"} - set(parts))
        raise WeightsError(f"{layer}: the checkpoint lacks its {', '.join(missing)}")


def with_base(
    groups: Iterable[Mapping[str, torch.Tensor]], base: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[dict[str, torch.Tensor]]:
    """An adapter-only checkpoint's groups, then the base tensors it does not hold (from the
    model the run started from)."""
    seen: set[str] = set()
    for group in groups:
        seen.update(group)
        yield dict(group)
    for name, tensor in base:
        if name not in seen:
            yield {name: tensor}


def adapters_of(groups: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The adapter tensors among canonical groups (the rest is dropped as it streams by)."""
    return {n: t for g in groups for n, t in g.items() if is_adapter(n)}


def hf_param_names(like: HFModel) -> dict[str, str]:
    """{HF tensor name (hf_weights' rule style): the parameter's name in the model class
    transformers builds (on the meta device: no memory)}, matched by the longest common tail
    of dotted names. For a remote-code family the file's own names."""
    from megatron_omnibal.models.hf_weights import SafetensorsReader

    style = SafetensorsReader(like).style
    file_names = {n: to_file_name(n, style) for rule in rules_for(like) for n in rule.hf}
    if not family_of(like).transformers_class:
        return file_names
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(like.path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    params = [n.split(".") for n, _ in model.named_parameters()]
    out = {}
    for rule_name, file_name in file_names.items():
        tail = file_name.split(".")
        best, score, tied = None, -1, False
        for parts in params:
            common = 0
            while common < min(len(parts), len(tail)) and parts[-1 - common] == tail[-1 - common]:
                common += 1
            if common > score:
                best, score, tied = parts, common, False
            elif common == score:
                tied = True
        if best is not None and score >= 2 and not tied:
            out[rule_name] = ".".join(best)
    return out


def peft_tensors(
    adapters: Mapping[str, torch.Tensor], like: HFModel, names: Mapping[str, str]
) -> dict[str, torch.Tensor]:
    """PEFT's `base_model.model.<module>.lora_A/lora_B.weight` tensors of the adapters."""
    rules = {r.canonical: r for r in rules_for(like)}
    out: dict[str, torch.Tensor] = {}
    layers = sorted({n.rpartition(".")[0] for n in adapters})
    for layer in layers:
        a, b = adapters.get(f"{layer}.lora_a"), adapters.get(f"{layer}.lora_b")
        if a is None or b is None:
            raise WeightsError(f"{layer}: the checkpoint holds only one of lora_a / lora_b")
        rule = rules.get(f"{layer}.weight")
        if rule is None:
            raise WeightsError(f"{layer}: no Hugging Face weight of {like.path} matches it")
        for hf_name, piece in zip(rule.hf, rule.to_hf(b), strict=True):
            param = names.get(hf_name)
            if param is None:
                raise WeightsError(f"{hf_name}: no module of the {like.family} model holds it")
            module = param[: -len(".weight")]
            out[f"base_model.model.{module}.lora_A.weight"] = a.clone()  # one copy each
            out[f"base_model.model.{module}.lora_B.weight"] = piece.contiguous()
    return out


def saved_modules(
    trained: Mapping[str, torch.Tensor], like: HFModel, names: Mapping[str, str]
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The parts trained in full as PEFT's `modules_to_save`: their tensors under
    `base_model.model.<parameter>` and each part's module (the longest common prefix of its
    parameters, e.g. model.multi_modal_projector)."""
    rules = {r.canonical: r for r in rules_for(like)}
    tensors: dict[str, torch.Tensor] = {}
    by_part: dict[str, list[list[str]]] = {}
    for name, tensor in trained.items():
        rule = rules.get(name)
        if rule is None:
            raise WeightsError(f"{name}: no Hugging Face tensor of {like.path} matches it")
        for hf_name, piece in zip(rule.hf, rule.to_hf(tensor), strict=True):
            param = names.get(hf_name)
            if param is None:
                raise WeightsError(f"{hf_name}: no parameter of the {like.family} model is it")
            tensors[f"base_model.model.{param}"] = piece.contiguous()
            by_part.setdefault(trained_part(name), []).append(param.split(".")[:-1])
    modules = []
    for part, paths in sorted(by_part.items()):
        prefix = paths[0]
        for path in paths[1:]:
            common = 0
            while common < min(len(prefix), len(path)) and prefix[common] == path[common]:
                common += 1
            prefix = prefix[:common]
        if not prefix:
            raise WeightsError(f"the {part}'s parameters share no module of the model")
        modules.append(".".join(prefix))
    return tensors, modules


_PART_PREFIXES = {
    "vit": ("patch_embed.", "vit.", "vit_final_norm."),
    "projector": ("projector.",),
}


def trained_part(name: str) -> str:
    """The part (vit, projector) a canonical tensor belongs to ('' for others)."""
    return next((p for p, pre in _PART_PREFIXES.items() if name.startswith(pre)), "")


def write_peft_adapter(
    adapters: Mapping[str, torch.Tensor], like: HFModel, lora: LoraSpec, out: Path,
    dtype: torch.dtype | None = None, trained: Mapping[str, torch.Tensor] | None = None,
) -> list[str]:  # fmt: skip
    """adapter_config.json + adapter_model.safetensors that `peft.PeftModel.from_pretrained(
    base, out)` loads on `like`'s model; `trained`: the canonical tensors of the parts trained
    in full, saved as PEFT's modules_to_save. Returns the adapted HF module names."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    reason = peft_refusal(lora)
    if reason is not None:
        raise WeightsError(reason)
    names = hf_param_names(like)
    tensors = peft_tensors(adapters, like, names)
    targets = sorted({k[len("base_model.model."): -len(".lora_A.weight")]
                      for k in tensors if k.endswith(".lora_A.weight")})  # fmt: skip
    modules: list[str] = []
    if lora.train:
        full, modules = saved_modules(trained or {}, like, names)
        tensors.update(full)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    config = LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
        bias="none", base_model_name_or_path=str(like.path), modules_to_save=modules or None,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return targets
