"""LoRA: which linear layers of the model get low-rank adapters, with which rank and scale.

Why here, on the pure side: the training flags, `omnibal finetune`, the planner's memory model
and the exporter all need the same answer to "which layers does this LoRA adapt, how wide are
they" before any process group or module exists. Layers are named model-wide as the stage
module names its linear layers (`llm.layers.3.self_attention.linear_qkv`, global layer index);
a target is a glob over those names, and a bare name (`linear_qkv`) means the LLM's layers of
that name. Adapters: y = W x + alpha / rank * B A dropout(x), B starting at zero, A [rank, in]
and B [out, rank] whole (canonical) shapes at TP = 1.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from megatron_omnibal.models.spec import ModelSpec

LINEARS = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
TRAINABLE_PARTS = ("vit", "projector", "llm")
ADAPTER_SUFFIXES = (".lora_a", ".lora_b")


class LoraError(ValueError):
    """A LoRA setting the model cannot take; the message names the setting and the layer."""


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """A LoRA run's adapters: rank, alpha, dropout on the adapter's input, target globs, and
    the parts trained in full beside them (everything else is frozen)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    train: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise LoraError(f"LoRA rank must be an integer >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise LoraError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not self.targets or any(not t.strip() for t in self.targets):
            raise LoraError(f"LoRA targets: an empty target in {list(self.targets)}")
        unknown = sorted(set(self.train) - set(TRAINABLE_PARTS))
        if unknown:
            raise LoraError(
                f"LoRA train: unknown part(s) {', '.join(unknown)} (choose from "
                f"{', '.join(TRAINABLE_PARTS)})"
            )

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of B A (PEFT's scaling without rsLoRA)."""
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": list(self.targets), "train": list(self.train)}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict) -> LoraSpec:
        return cls(rank=int(data["rank"]), alpha=float(data["alpha"]),
                   dropout=float(data.get("dropout", 0.0)),
                   targets=tuple(data.get("targets", DEFAULT_TARGETS)),
                   train=tuple(data.get("train", ())))  # fmt: skip


@dataclass(frozen=True)
class LoraLayer:
    """One adapted linear layer: its model-wide name, input and output width (TP = 1), and
    whether megatron-core splits it by output (column-parallel) or by input (row-parallel)."""

    name: str
    in_features: int
    out_features: int
    column: bool

    @property
    def tower(self) -> str:
        return self.name.split(".", 1)[0]


def linear_layers(spec: ModelSpec) -> list[LoraLayer]:
    """Every linear layer of both towers' transformer layers that can carry an adapter."""
    out: list[LoraLayer] = []
    v, llm = spec.vit, spec.llm
    vit_fc1 = (2 if v.gated_mlp else 1) * v.ffn_hidden_size
    llm_fc1 = (2 if llm.gated_mlp else 1) * llm.ffn_hidden_size
    widths = {
        "vit": {
            "self_attention.linear_qkv": (v.hidden_size, 3 * v.hidden_size, True),
            "self_attention.linear_proj": (v.hidden_size, v.hidden_size, False),
            "mlp.linear_fc1": (v.hidden_size, vit_fc1, True),
            "mlp.linear_fc2": (v.ffn_hidden_size, v.hidden_size, False),
        },
        "llm": {
            "self_attention.linear_qkv": (llm.hidden_size, llm.q_size + 2 * llm.kv_size, True),
            "self_attention.linear_proj": (llm.q_size, llm.hidden_size, False),
            "mlp.linear_fc1": (llm.hidden_size, llm_fc1, True),
            "mlp.linear_fc2": (llm.ffn_hidden_size, llm.hidden_size, False),
        },
    }
    for tower, depth in (("vit", v.num_layers), ("llm", llm.num_layers)):
        for i in range(depth):
            for suffix in LINEARS:
                fan_in, fan_out, column = widths[tower][suffix]
                out.append(LoraLayer(f"{tower}.layers.{i}.{suffix}", fan_in, fan_out, column))
    return out


def matches(target: str, name: str) -> bool:
    """Whether glob `target` names layer `name` (a bare name: the LLM's layers so named)."""
    target = target.strip()
    if target.startswith(("vit.", "llm.", "*")):
        return fnmatch.fnmatchcase(name, target)
    return fnmatch.fnmatchcase(name, f"llm.layers.*.{target}")


def lora_layers(
    spec: ModelSpec, lora: LoraSpec, where: str = "LoRA targets", rank_where: str = "LoRA rank"
) -> dict[str, LoraLayer]:
    """{model-wide name: layer} of the adapted layers; raises LoraError naming a target that
    matches no layer (`where` names the setting) or a layer narrower than the rank."""
    layers = linear_layers(spec)
    chosen: dict[str, LoraLayer] = {}
    for target in lora.targets:
        hit = [layer for layer in layers if matches(target, layer.name)]
        if not hit:
            raise LoraError(
                f"{where}: '{target}' matches no layer of the model (layers are named like "
                "llm.layers.0.self_attention.linear_qkv or vit.layers.0.mlp.linear_fc1; a bare "
                f"name is the LLM's: {', '.join(DEFAULT_TARGETS)})"
            )
        chosen.update({layer.name: layer for layer in hit})
    for layer in chosen.values():
        width = min(layer.in_features, layer.out_features)
        if lora.rank > width:
            raise LoraError(
                f"{rank_where} {lora.rank} is above the width of {layer.name} "
                f"({layer.in_features} -> {layer.out_features}): at most {width}"
            )
    return dict(sorted(chosen.items(), key=lambda kv: _order(kv[0])))


def _order(name: str) -> tuple[int, int, str]:
    tower, _, index, rest = name.split(".", 3)
    return (0 if tower == "vit" else 1, int(index), rest)


def check_frozen(
    spec: ModelSpec, lora: LoraSpec, frozen: frozenset[str] | set[str],
    where: str = "LoRA targets", train_where: str = "LoRA train",
) -> None:  # fmt: skip
    """Refuse adapters (or full training) on a part another setting freezes, naming both."""
    for layer in lora_layers(spec, lora).values():
        if layer.tower in frozen:
            raise LoraError(
                f"{where}: LoRA on {layer.name}, but the {layer.tower.upper()} is frozen by "
                f"--omnibal-freeze "
                f"{layer.tower} (drop it there or leave the layer out of the LoRA targets)"
            )
    for part in lora.train:
        if part in frozen:
            raise LoraError(
                f"{train_where} {part}: the part is frozen by --omnibal-freeze {part}"
            )


def is_adapter(name: str) -> bool:
    """Whether a canonical tensor name is a LoRA adapter's A or B."""
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_parameters(spec: ModelSpec, lora: LoraSpec) -> int:
    """The number of adapter parameters of the model (TP = 1, no padding)."""
    return sum(lora.rank * (layer.in_features + layer.out_features)
               for layer in lora_layers(spec, lora).values())  # fmt: skip


def peft_refusal(lora: LoraSpec) -> str | None:
    """Why a PEFT adapter cannot hold this run (None: it can). Parts trained in full become
    PEFT's modules_to_save, which cannot hold adapters of their own or be the whole LLM."""
    if "llm" in lora.train:
        return ("the LLM was trained in full beside the adapters: a PEFT adapter cannot hold "
                "it (the merged model does)")  # fmt: skip
    if "vit" in lora.train and any(t.strip().startswith(("vit.", "*")) for t in lora.targets):
        return ("the ViT was trained in full and has adapters: PEFT's modules_to_save cannot "
                "hold adapters (the merged model holds both)")  # fmt: skip
    return None
