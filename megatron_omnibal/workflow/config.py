"""The fine-tuning config: one YAML file a user keeps beside their data.

Every key is checked when the file is read, and an error names the file and the key, since a
typo in a config that drives hours of GPU time must stop the run at once, not be ignored.
Relative paths are read from the config file's folder.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_omnibal.data.text.conversations import TEMPLATES
from megatron_omnibal.megatron.flags.declarations import config_key, config_settings, setting
from megatron_omnibal.megatron.stages.finetune import PARTS
from megatron_omnibal.models.lora import LoraError, LoraSpec
from megatron_omnibal.models.spec import ModelSpec, check_expert_parallel

DEVICES = ("cuda", "cpu")
PATH_KEYS = ("model", "data", "output", "image_root", "tokenizer")


@dataclass(frozen=True, kw_only=True)
class FinetuneConfig:
    """What `omnibal finetune` runs; see docs/finetune.md for each key."""

    model: str  # Hugging Face checkpoint directory
    data: str  # InternVL meta JSON, LLaVA JSON or ShareGPT JSONL
    output: str  # directory that receives everything
    image_root: str | None = None  # image folder of a JSON/JSONL dataset (default: its folder)
    tokenizer: str | None = None  # default: the model directory's
    trust_remote_code: bool = False
    system_prompt: str | None = None  # default: the chat template's own
    template: str | None = None  # chat template; default: the checkpoint's own, as stats picks
    hardware: str = "H100-80G"  # GPU preset or a JSON/YAML hardware file, for the plan
    nodes: int = 1
    gpus_per_node: int = 8
    device: str = "cuda"  # cuda, or cpu: gloo processes, a trial run
    master_addr: str | None = None  # node 0's address for the launch scripts (nodes > 1)
    master_port: int = 29500
    tp: int | None = None  # default: the plan searches it
    pp: int | None = None
    ep: int | None = None  # expert parallel size of a mixture-of-experts LLM (default: searched)
    iters: int | None = None  # training steps, or
    epochs: int | None = None  # passes over the data (default 1 when iters is not given)
    lr: float = 2e-5
    min_lr: float = 0.0
    warmup: float = 0.03  # a fraction of the steps (< 1), or a number of steps
    global_batch: int = 128  # samples per step the plan aims at
    freeze: tuple[str, ...] = ()  # parts kept fixed: vit, projector, llm
    vit_lr_mult: float = setting("--omnibal-vit-lr-mult").default
    save_interval: int = 500
    log_interval: int = 10
    seed: int = 42
    megatron_args: tuple[str, ...] = ()  # passed through to Megatron, last
    preflight: bool | dict[str, Any] = True  # the preflight step: off, on, or on with options
    lora: dict[str, Any] | None = None  # LoRA adapters: rank, alpha, dropout, targets, train

    def __post_init__(self) -> None:
        for key in ("model", "data", "output"):
            _expect(
                isinstance(getattr(self, key), str) and getattr(self, key),
                key,
                "a path",
                getattr(self, key),
            )
        for key in ("image_root", "tokenizer", "system_prompt", "master_addr"):
            value = getattr(self, key)
            _expect(value is None or isinstance(value, str), key, "a string", value)
        _expect(self.template is None or self.template in TEMPLATES, "template",
                f"one of {', '.join(TEMPLATES)}", self.template)
        _expect(
            isinstance(self.trust_remote_code, bool),
            "trust_remote_code",
            "true or false",
            self.trust_remote_code,
        )
        _expect(
            isinstance(self.hardware, str), "hardware", "a preset name or a file", self.hardware
        )
        _expect(self.device in DEVICES, "device", " or ".join(DEVICES), self.device)
        for key in (
            "nodes",
            "gpus_per_node",
            "global_batch",
            "save_interval",
            "log_interval",
            "master_port",
        ):
            _expect(_is_int(getattr(self, key), 1), key, "a positive integer", getattr(self, key))
        for key in ("tp", "pp", "ep", "iters", "epochs"):
            value = getattr(self, key)
            _expect(value is None or _is_int(value, 1), key, "a positive integer", value)
        _expect(_is_int(self.seed, 0), "seed", "a non-negative integer", self.seed)
        if self.iters is not None and self.epochs is not None:
            raise ValueError("iters and epochs: give one of them, not both")
        _expect(_is_number(self.lr) and self.lr > 0, "lr", "a positive number", self.lr)
        _expect(
            _is_number(self.min_lr) and 0 <= self.min_lr <= self.lr,
            "min_lr",
            f"a number from 0 to lr ({self.lr})",
            self.min_lr,
        )
        _expect(
            _is_number(self.warmup)
            and self.warmup >= 0
            and (self.warmup < 1 or float(self.warmup).is_integer()),
            "warmup",
            "a fraction below 1 or a whole number of steps",
            self.warmup,
        )
        _expect(
            _is_number(self.vit_lr_mult) and self.vit_lr_mult > 0,
            "vit_lr_mult",
            "a positive number",
            self.vit_lr_mult,
        )
        _expect(
            isinstance(self.freeze, tuple) and set(self.freeze) <= set(PARTS),
            "freeze",
            f"a list of {', '.join(PARTS)}",
            list(self.freeze),
        )
        _expect(
            isinstance(self.megatron_args, tuple)
            and all(isinstance(a, str) for a in self.megatron_args),
            "megatron_args",
            "a list of strings",
            list(self.megatron_args),
        )
        if "vit" in self.freeze and self.vit_lr_mult != 1.0:
            raise ValueError("vit_lr_mult has no effect with freeze: [vit]")
        _expect(
            isinstance(self.preflight, (bool, dict)),
            "preflight",
            "true, false or a mapping of preflight options",
            self.preflight,
        )
        preflight_flags(self.preflight)  # an unknown option or a bad value stops here
        self.lora_spec  # noqa: B018 - a bad `lora` setting stops here

    @property
    def lora_spec(self) -> LoraSpec | None:
        """The `lora` mapping as LoRA settings (None: full-parameter training)."""
        return lora_spec(self.lora)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def out(self) -> Path:
        return Path(self.output)

    @property
    def runs_preflight(self) -> bool:
        return self.preflight is not False


def preflight_flags(setting: bool | dict[str, Any]) -> list[str]:
    """The preflight's own flags for the config's `preflight` (a mapping of its options, keys
    with `_` for `-`: `device_memory_gib: 70` is `--device-memory-gib 70`), each value checked
    as the preflight checks its flag."""
    from megatron_omnibal.preflight.options import config_options

    if isinstance(setting, bool):
        return []
    options = config_options()
    flags = []
    for key, value in setting.items():
        if key not in options:
            raise ValueError(
                f"preflight: unknown option {key!r} (known: {', '.join(options)})"
            )
        try:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError(f"expected a number, got {value!r}")
            options[key](str(value))
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"preflight.{key}: {exc}") from exc
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


# the `lora` mapping's keys and defaults: those of the --omnibal-lora-* flags they set
LORA_KEYS = tuple(config_key(s, "lora") for s in config_settings("lora"))
LORA_DEFAULTS = {
    config_key(s, "lora"): s.default for s in config_settings("lora") if s.default is not None
}


def lora_spec(setting: dict[str, Any] | None) -> LoraSpec | None:
    """`lora:` of the config (rank required; alpha, dropout, targets, train as the
    --omnibal-lora-* flags default them), each key checked."""
    if setting is None:
        return None
    _expect(isinstance(setting, dict), "lora", "a mapping with rank, alpha, ...", setting)
    unknown = [k for k in setting if k not in LORA_KEYS]
    if unknown:
        raise ValueError(f"lora: unknown key(s) {', '.join(map(repr, unknown))} (known: "
                         f"{', '.join(LORA_KEYS)})")  # fmt: skip
    _expect("rank" in setting and _is_int(setting["rank"], 1), "lora.rank",
            "a positive integer", setting.get("rank"))  # fmt: skip
    values = {**LORA_DEFAULTS, **setting}
    for key in ("alpha", "dropout"):
        values[key] = _number(values[key])
        _expect(_is_number(values[key]), f"lora.{key}", "a number", values[key])
    for key in ("targets", "train"):
        if isinstance(values.get(key), str):
            values[key] = [t.strip() for t in values[key].split(",")]
        if key in values:
            _expect(isinstance(values[key], list) and all(isinstance(t, str) for t in values[key]),
                    f"lora.{key}", "a list of names", values[key])  # fmt: skip
    try:
        return LoraSpec.from_dict(values)
    except LoraError as exc:
        raise ValueError(f"lora: {exc}") from exc


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _expect(ok: bool, key: str, what: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{key}: expected {what}, got {value!r}")


def known_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(FinetuneConfig)]


def config_from_dict(doc: dict[str, Any], base: Path) -> FinetuneConfig:
    """The config of a parsed mapping; relative paths are taken from `base`."""
    known = known_keys()
    unknown = [k for k in doc if k not in known]
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(map(repr, unknown))} (known: {', '.join(known)})"
        )
    missing = [k for k in ("model", "data", "output") if k not in doc]
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    values = dict(doc)
    for key in ("freeze", "megatron_args"):
        if isinstance(values.get(key), list):
            values[key] = tuple(values[key])
    for key in ("lr", "min_lr", "warmup", "vit_lr_mult"):  # YAML reads 2e-5 as a string
        if key in values:
            values[key] = _number(values[key])
    values = {k: v for k, v in values.items() if v is not None}  # null: the default
    for key in PATH_KEYS:
        if isinstance(values.get(key), str) and values[key]:
            values[key] = str((base / Path(values[key]).expanduser()).resolve())
    return FinetuneConfig(**values)


def _number(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def load_config(path: str | Path) -> FinetuneConfig:
    """Read and check a config file; every error names the file (and the key)."""
    from megatron_omnibal.models.resolve import read_mapping

    path = Path(path)
    try:
        config = config_from_dict(read_mapping(path), path.resolve().parent)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    except TypeError as exc:  # e.g. a key given a mapping where a value belongs
        raise ValueError(f"{path}: {exc}") from exc
    _check_paths(config, path)
    _check_lora(config, path)
    _check_expert_parallel(config, path)
    return config


def _model_spec(config: FinetuneConfig) -> ModelSpec | None:
    """The checkpoint's spec; None for a model `omnibal stats` cannot read (its step says why)."""
    from megatron_omnibal.models.hf_config import read_hf

    try:
        return read_hf(config.model).spec
    except ValueError:
        return None


def _check_expert_parallel(config: FinetuneConfig, path: Path) -> None:
    """`ep` against the model: it must divide the LLM's experts (a dense LLM has none)."""
    spec = None if config.ep is None else _model_spec(config)
    if spec is None:
        return
    try:
        check_expert_parallel(spec, config.ep)
    except ValueError as exc:
        raise ValueError(f"{path}: ep: {exc}") from exc


def _check_lora(config: FinetuneConfig, path: Path) -> None:
    """LoRA's targets and rank against the model, its parts against `freeze`."""
    spec = None if config.lora_spec is None else _model_spec(config)
    if spec is None:
        return
    from megatron_omnibal.models.lora import check_frozen, lora_layers

    try:
        lora_layers(spec, config.lora_spec, "lora.targets", "lora.rank")
        check_frozen(spec, config.lora_spec, set(config.freeze), "lora.targets", "lora.train")
    except LoraError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def _check_paths(config: FinetuneConfig, path: Path) -> None:
    if not (Path(config.model) / "config.json").is_file():
        raise ValueError(
            f"{path}: model: {config.model} is not a Hugging Face checkpoint "
            "directory (no config.json)"
        )
    if not Path(config.data).is_file():
        raise ValueError(f"{path}: data: no such file: {config.data}")
    for key in ("image_root",):
        value = getattr(config, key)
        if value is not None and not Path(value).is_dir():
            raise ValueError(f"{path}: {key}: no such folder: {value}")
    if config.tokenizer is not None and not Path(config.tokenizer).exists():
        raise ValueError(f"{path}: tokenizer: no such file or folder: {config.tokenizer}")
