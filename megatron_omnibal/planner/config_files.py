"""User-described models and GPUs, read from JSON or YAML.

A model file holds the same blocks as plan.json's `model_spec` (`vit`, `projector`, `llm`, and
optionally `name`, `tokens_per_tile`); a hardware file holds the fields of `Hardware`. Every
field is checked, and an error names the file and the field, since a typo here would silently
plan a different model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron_omnibal.planner.hardware import Hardware, get_hardware
from megatron_omnibal.planner.models import LLMSpec, ModelSpec, ProjectorSpec, ViTSpec, get_model


def read_json(path: str | Path, what: str) -> Any:
    """Parse a JSON file; errors name the file and what it was meant to be."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such {what} file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc


def read_config(path: str | Path) -> dict:
    """Parse a JSON or YAML mapping (YAML by suffix .yaml/.yml)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            doc = yaml.safe_load(text)
        else:
            doc = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - any parser error becomes one clear message
        raise ValueError(f"{path}: cannot parse: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return doc


def _build(cls: type, doc: Any, where: str, drop: tuple[str, ...] = ()) -> Any:
    """Instantiate dataclass `cls` from `doc`, checking names and types field by field."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in doc.items():
        if key in drop:
            continue
        if key not in fields:
            raise ValueError(f"{where}: unknown field '{key}' (known: {', '.join(fields)})")
        kind = fields[key].type
        if kind in ("int", int):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{where}.{key}: expected a positive integer, got {value!r}")
        elif kind in ("float", float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{where}.{key}: expected a non-negative number, got {value!r}")
            value = float(value)
        elif kind in ("bool", bool) and not isinstance(value, bool):
            raise ValueError(f"{where}.{key}: expected true or false, got {value!r}")
        elif kind in ("str", str) and not isinstance(value, str):
            raise ValueError(f"{where}.{key}: expected a string, got {value!r}")
        kwargs[key] = value
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    return cls(**kwargs)


def model_from_dict(doc: dict, where: str = "model") -> ModelSpec:
    """A ModelSpec from a `model_spec`-shaped mapping."""
    for block in ("vit", "llm"):
        if block not in doc:
            raise ValueError(f"{where}: missing block '{block}'")
    vit = dict(doc["vit"])
    llm = dict(doc["llm"])
    if "vit_class_token" in doc:
        vit["class_token"] = doc["vit_class_token"]
    if "llm_gated_mlp" in doc:
        llm["gated_mlp"] = doc["llm_gated_mlp"]
    spec = ModelSpec(
        name=str(doc.get("name", where)),
        vit=_build(ViTSpec, vit, f"{where}.vit"),
        projector=_build(ProjectorSpec, doc.get("projector", {}), f"{where}.projector"),
        llm=_build(LLMSpec, llm, f"{where}.llm"),
        source=str(doc.get("source", where)),
        tokens_per_tile=int(doc.get("tokens_per_tile", 0)),
    )
    if spec.llm.hidden_size % spec.llm.num_attention_heads:
        raise ValueError(f"{where}.llm: hidden_size not divisible by num_attention_heads")
    if spec.llm.num_attention_heads % spec.llm.num_query_groups:
        raise ValueError(f"{where}.llm: num_attention_heads not divisible by num_query_groups")
    return spec


def resolve_model(name_or_path: str) -> ModelSpec:
    """A preset name, or a JSON/YAML file describing the model."""
    if Path(name_or_path).suffix in (".json", ".yaml", ".yml"):
        doc = read_config(name_or_path)
        doc.setdefault("name", Path(name_or_path).stem)
        return model_from_dict(doc, str(name_or_path))
    return get_model(name_or_path)


def resolve_hardware(name_or_path: str) -> Hardware:
    """A preset name, or a JSON/YAML file with the fields of `Hardware`."""
    if Path(name_or_path).suffix in (".json", ".yaml", ".yml"):
        doc = read_config(name_or_path)
        doc.setdefault("name", Path(name_or_path).stem)
        return _build(Hardware, doc, str(name_or_path))
    return get_hardware(name_or_path)
