"""The `--omnibal-lora-*` flags: LoRA adapters instead of full-parameter training.

Why checked here, before any process group: a target that matches no layer, a rank wider than a
layer, or an adapter on a part `--omnibal-freeze` keeps fixed must stop every rank with a message
naming the flag and the layer. The defaults are those of `swift sft --tuner_type lora` and
Megatron-Bridge's LoRA recipes: rank 8, alpha 32, dropout 0.05, the LLM's attention and MLP
linear layers.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_omnibal.cli_args import positive_float, positive_int
from megatron_omnibal.models.lora import (
    DEFAULT_TARGETS,
    TRAINABLE_PARTS,
    LoraError,
    LoraSpec,
    check_frozen,
    lora_layers,
)
from megatron_omnibal.models.spec import ModelSpec

SAVES = ("adapters", "full")


def _names(text: str) -> list[str]:
    # A plain list: Megatron pickles args into checkpoints, which torch.load reads weights-only.
    return [t.strip() for t in text.split(",") if t.strip()]


def _dropout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def add_lora_args(group: Any) -> None:
    """The LoRA flags (in the --omnibal argument group)."""
    group.add_argument(
        "--omnibal-lora-rank", type=positive_int, default=None, metavar="R",
        help="train LoRA adapters of rank R beside the frozen base weights (default: no LoRA, "
        "full-parameter training)",
    )  # fmt: skip
    group.add_argument(
        "--omnibal-lora-alpha", type=positive_float, default=32.0, metavar="A",
        help="LoRA alpha: the adapters add alpha/rank * B A x (default 32)",
    )  # fmt: skip
    group.add_argument(
        "--omnibal-lora-dropout", type=_dropout, default=0.05, metavar="P",
        help="dropout on the adapters' input (default 0.05)",
    )  # fmt: skip
    group.add_argument(
        "--omnibal-lora-targets", type=_names, default=list(DEFAULT_TARGETS), metavar="GLOBS",
        help="comma-separated layers to adapt: globs over names like "
        "llm.layers.3.self_attention.linear_qkv or vit.layers.0.mlp.linear_fc1; a bare name is "
        f"the LLM's layers of that name (default: {','.join(DEFAULT_TARGETS)}; the ViT's: "
        "vit.*)",
    )  # fmt: skip
    group.add_argument(
        "--omnibal-lora-train", type=_names, default=[], metavar="PARTS",
        help="parts trained in full beside the adapters: "
        f"{', '.join(TRAINABLE_PARTS)} (default: none, every base weight frozen)",
    )  # fmt: skip
    group.add_argument(
        "--omnibal-lora-save", choices=SAVES, default=None,
        help="what checkpoints hold: the adapters (and the parts trained in full; the base "
        "comes from --pretrained-checkpoint) or the full model (default: adapters with "
        "--pretrained-checkpoint, else full)",
    )  # fmt: skip


def lora_settings(args: argparse.Namespace) -> LoraSpec | None:
    """The run's LoRA (None without --omnibal-lora-rank); raises LoraError naming the flag."""
    if getattr(args, "omnibal_lora_rank", None) is None:
        return None
    try:
        return LoraSpec(
            rank=args.omnibal_lora_rank, alpha=args.omnibal_lora_alpha,
            dropout=args.omnibal_lora_dropout, targets=tuple(args.omnibal_lora_targets),
            train=tuple(args.omnibal_lora_train),
        )  # fmt: skip
    except LoraError as exc:
        raise LoraError(f"--omnibal-lora-*: {exc}") from exc


def lora_save(args: argparse.Namespace) -> str:
    """adapters | full, checked against --pretrained-checkpoint."""
    pretrained = getattr(args, "pretrained_checkpoint", None)
    save = args.omnibal_lora_save or ("adapters" if pretrained else "full")
    if save == "adapters" and not pretrained:
        raise LoraError(
            "--omnibal-lora-save adapters: the base weights must come from "
            "--pretrained-checkpoint (an adapter-only save does not hold them)"
        )
    return save


def check_lora_model(lora: LoraSpec, spec: ModelSpec, frozen: frozenset[str]) -> None:
    """The targets, rank and trained parts against the model and --omnibal-freeze."""
    lora_layers(spec, lora, "--omnibal-lora-targets", "--omnibal-lora-rank")
    check_frozen(spec, lora, frozen, "--omnibal-lora-targets", "--omnibal-lora-train")
