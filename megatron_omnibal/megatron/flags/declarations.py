"""Every --omnibal* setting declared once: its flag, how its text is parsed (the type, which
holds its range), its default and help, and the key of `omnibal finetune`'s config that sets it.

Why one table: the training's argparse flags (`add_omnibal_args`), the finetune config's LoRA
keys and defaults, and the flags the finetune workflow hands to training are all generated from
it, so a new setting or a changed default is one line here, not three edits that can disagree.
Nothing here imports torch or Megatron.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from megatron_omnibal.balance.config import ALGORITHMS, MODES, OVERSIZE
from megatron_omnibal.cli_args import non_negative_int, pack_cost, positive_float, positive_int
from megatron_omnibal.models.lora import DEFAULT_TARGETS, TRAINABLE_PARTS

BAD_SAMPLE = ("error", "skip")
PRECISIONS = ("bf16", "fp16", "fp32")
LORA_SAVES = ("adapters", "full")


def int_list(text: str) -> tuple[int, ...]:
    """'30,15,0,0' -> (30, 15, 0, 0): layer counts, each >= 0."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 30,15,0,0, got '{text}'"
        ) from exc
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"layer counts must be >= 0, got '{text}'")
    return values


def names(text: str) -> list[str]:
    """'a, b' -> ['a', 'b']. A plain list: Megatron pickles args into checkpoints, which
    torch.load reads weights-only."""
    return [t.strip() for t in text.split(",") if t.strip()]


def parts(text: str) -> list[str]:
    """Comma-separated parts, sorted and each once (a plain list, as `names`)."""
    return sorted({p.strip() for p in text.split(",") if p.strip()})


def dropout(text: str) -> float:
    """A dropout probability in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _text(value: Any) -> str:
    """A config value as the flag's text: lists comma-joined."""
    return ",".join(value) if isinstance(value, (list, tuple)) else str(value)


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One --omnibal* setting. `parse` turns the flag's text into the value and holds its
    range (argparse reports its error with the flag); `switch`: a flag without a value.
    `config_key`: the key of `omnibal finetune`'s config that sets it (`lora.alpha`: the `alpha`
    of its `lora` mapping), None where the workflow decides it or has none; `always`: the
    workflow passes it even at its default (the LoRA flags a run prints)."""

    flag: str
    help: str
    parse: Callable[[str], Any] | None = None
    default: Any = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    switch: bool = False
    config_key: str | None = None
    always: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def add_to(self, group: Any) -> None:
        """This setting's argparse flag in `group`."""
        if self.switch:
            group.add_argument(self.flag, action="store_true", help=self.help)
            return
        default = list(self.default) if isinstance(self.default, list) else self.default
        options: dict[str, Any] = {"default": default, "help": self.help}
        for key, value in (("type", self.parse), ("choices", self.choices),
                           ("metavar", self.metavar)):  # fmt: skip
            if value is not None:
                options[key] = value
        group.add_argument(self.flag, **options)

    def argv(self, value: Any) -> list[str]:
        """The flag setting `value` (none at the default, unless `always`)."""
        if value is None or value == "" or (value == self.default and not self.always):
            return []
        if isinstance(value, (list, tuple)) and not value:
            return []
        return [self.flag] if self.switch else [self.flag, _text(value)]


S = Setting
DEFAULT_PLAN = "(default: the plan's)"
RECOMPUTE_DEFAULT = "(default: the plan's, per level with levels, else none)"

SETTINGS: tuple[Setting, ...] = (
    S(flag="--omnibal", switch=True,
      help="train the VLM with balanced data, a planned split and planned recompute"),
    S(flag="--omnibal-plan", metavar="PLAN.json",
      help="plan from `omnibal plan`: stage layout, recompute and data budgets; its parallel "
      "sizes, batch, precision, model shape and length file are filled in where not given"),
    S(flag="--omnibal-lengths", metavar="FILE",
      help="per-sample length statistics of the training data (vit_num, token_num; "
      "default: the file the plan was made from)"),
    S(flag="--omnibal-vit-pp-layers", parse=int_list, metavar="N,N,..",
      help="ViT layers per pipeline stage, e.g. 30,15,0,0 (instead of a plan)"),
    S(flag="--omnibal-llm-pp-layers", parse=int_list, metavar="N,N,..",
      help="LLM layers per pipeline stage, e.g. 0,10,19,19 (instead of a plan)"),
    S(flag="--omnibal-vit-recompute", parse=int_list, metavar="N,N,..",
      help=f"ViT layers to recompute per stage, at every packing level {RECOMPUTE_DEFAULT}"),
    S(flag="--omnibal-llm-recompute", parse=int_list, metavar="N,N,..",
      help=f"LLM layers to recompute per stage, at every packing level {RECOMPUTE_DEFAULT}"),
    S(flag="--omnibal-vit-budget", parse=positive_int,
      help=f"image tiles per micro-batch the balancer aims at {DEFAULT_PLAN}"),
    S(flag="--omnibal-token-budget", parse=positive_int,
      help=f"LLM tokens per micro-batch the balancer aims at {DEFAULT_PLAN}"),
    S(flag="--omnibal-mode", choices=MODES, default="random",
      help="random: shuffle samples each epoch; grouped: keep dataset groups together"),
    S(flag="--omnibal-algorithm", choices=ALGORITHMS, default="default",
      help="balancer: fill-and-complete (default) or OmniBal's ISF"),
    S(flag="--omnibal-oversize", choices=OVERSIZE, default="error",
      help="a sample above a budget: error, a micro-batch of its own, or skip it"),
    S(flag="--omnibal-cost", parse=pack_cost, metavar="A,B,C",
      help="modeled time of a pack, A*tiles + B*tokens + C*sum(len^2) (default: the plan's "
      "data.pack_cost); steps are formed to even it out across ranks"),
    S(flag="--omnibal-levels", metavar="V/TxM,..",
      help="packing levels (tiles/tokens x micro-batches per rank), ascending, the last the "
      "budgets and --global-batch-size / DP micro-batches; each step runs its level's "
      "micro-batches (default: the plan's data.levels with their per-stage recompute, else "
      "one level)"),
    S(flag="--omnibal-curriculum-steps", parse=non_negative_int, default=0,
      help="with levels: this many steps of the shortest level open each epoch"),
    S(flag="--omnibal-model", metavar="NAME|FILE",
      help="model dimensions: a preset (tiny, small, or a planner preset) or a "
      "model_spec JSON/YAML file (default: the plan's model_spec)"),
    S(flag="--omnibal-precision", choices=PRECISIONS,
      help="training precision (default: Megatron's --bf16 / --fp16 where given, else the "
      "plan's, bf16; fp32 without a plan)"),
    S(flag="--omnibal-data", default="synthetic", metavar="synthetic|PATH",
      help="sample source: 'synthetic' (deterministic random samples shaped like the "
      "lengths) or the dataset the length file was computed from (LLaVA JSON/JSONL, "
      "InternVL meta, or a Megatron-Energon folder or metadataset: its split and task "
      "encoder are the ones `omnibal stats` used)"),
    S(flag="--omnibal-tokenizer", metavar="PATH", config_key="tokenizer",
      help="with --omnibal-data PATH: the tokenizer `omnibal stats` counted with, where it is "
      "now (default: the path stored in the length file; checked by fingerprint)"),
    S(flag="--omnibal-bad-sample", choices=BAD_SAMPLE, default="error",
      help="a sample whose image cannot be loaded: stop naming it (default), or skip it on "
      "every rank of its replica, log it and list it in the report"),
    S(flag="--omnibal-bad-sample-report", metavar="FILE.jsonl",
      help="report of skipped samples (default: omnibal_bad_samples.jsonl in --save, else in "
      "the working directory; .dpN per data-parallel replica when DP > 1)"),
    # fine-tuning: frozen parts, the ViT's learning rate (stages/finetune.py)
    S(flag="--omnibal-freeze", parse=parts, default=[], metavar="PARTS", config_key="freeze",
      help="comma-separated parts to keep fixed: vit, projector, llm (no gradient, no "
      "optimizer state)"),
    S(flag="--omnibal-vit-lr-mult", parse=positive_float, default=1.0, metavar="X",
      config_key="vit_lr_mult",
      help="the ViT's learning rate (and min lr) is X times the others' (InternVL trains its "
      "ViT at 0.1x)"),
    # LoRA (the defaults of `swift sft --tuner_type lora` and Megatron-Bridge's recipes)
    S(flag="--omnibal-lora-rank", parse=positive_int, metavar="R", config_key="lora.rank",
      always=True,
      help="train LoRA adapters of rank R beside the frozen base weights (default: no LoRA, "
      "full-parameter training)"),
    S(flag="--omnibal-lora-alpha", parse=positive_float, default=32.0, metavar="A",
      config_key="lora.alpha", always=True,
      help="LoRA alpha: the adapters add alpha/rank * B A x (default 32)"),
    S(flag="--omnibal-lora-dropout", parse=dropout, default=0.05, metavar="P",
      config_key="lora.dropout", always=True,
      help="dropout on the adapters' input (default 0.05)"),
    S(flag="--omnibal-lora-targets", parse=names, default=list(DEFAULT_TARGETS),
      metavar="GLOBS", config_key="lora.targets", always=True,
      help="comma-separated layers to adapt: globs over names like "
      "llm.layers.3.self_attention.linear_qkv or vit.layers.0.mlp.linear_fc1; a bare name is "
      f"the LLM's layers of that name (default: {','.join(DEFAULT_TARGETS)}; the ViT's: "
      "vit.*)"),
    S(flag="--omnibal-lora-train", parse=names, default=[], metavar="PARTS",
      config_key="lora.train",
      help="parts trained in full beside the adapters: "
      f"{', '.join(TRAINABLE_PARTS)} (default: none, every base weight frozen)"),
    S(flag="--omnibal-lora-save", choices=LORA_SAVES,
      help="what checkpoints hold: the adapters (and the parts trained in full; the base "
      "comes from --pretrained-checkpoint) or the full model (default: adapters with "
      "--pretrained-checkpoint, else full)"),
    S(flag="--omnibal-allow-data-change", switch=True,
      help="resume from a checkpoint trained on another data stream (other lengths, budgets, "
      "seed, DP size or balancer options): start a new epoch plan at the checkpoint's "
      "consumed samples instead of refusing"),
    S(flag="--omnibal-text-scale", parse=positive_int, default=1,
      help="synthetic data only: divide each sample's text tokens by this (a CPU dry run of "
      "long real lengths on a small model)"),
    S(flag="--omnibal-peak-tflops", parse=positive_float, metavar="TFLOPS",
      help="peak dense TFLOP/s of one GPU at the run's precision, for the MFU in the log "
      "(default: known A100/H100/H200 at BF16/FP16; otherwise MFU is n/a)"),
)  # fmt: skip


def add_settings(group: Any, settings: Iterable[Setting] = SETTINGS) -> None:
    """The flags of `settings` in an argparse group."""
    for setting in settings:
        setting.add_to(group)


def setting(flag: str) -> Setting:
    """The declaration of `flag`."""
    return next(s for s in SETTINGS if s.flag == flag)


def config_settings(section: str | None = None) -> list[Setting]:
    """The settings `omnibal finetune`'s config sets: its top-level keys (section None) or
    the keys of one of its mappings (`lora`)."""
    prefix = "" if section is None else f"{section}."
    return [
        s for s in SETTINGS
        if s.config_key is not None and s.config_key.startswith(prefix)
        and (section is not None or "." not in s.config_key)
    ]  # fmt: skip


def config_key(s: Setting, section: str) -> str:
    """`lora.alpha` -> `alpha`: the key inside the config's `section` mapping."""
    return s.config_key.removeprefix(f"{section}.")  # type: ignore[union-attr]
