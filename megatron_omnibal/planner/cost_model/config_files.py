"""User-described GPUs, read from JSON or YAML, and the JSON reader of planner files.

A hardware file holds the fields of `Hardware`. Every field is checked, and an error names the
file and the field, since a typo here would silently plan for different hardware. (Models are
resolved by megatron_omnibal.models.resolve.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron_omnibal.models.resolve import read_mapping
from megatron_omnibal.models.spec import missing_fields
from megatron_omnibal.planner.cost_model.hardware import Hardware, get_hardware


def read_json(path: str | Path, what: str) -> Any:
    """Parse a JSON file; errors name the file and what it was meant to be."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such {what} file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc


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
    missing = missing_fields(fields, kwargs)
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    return cls(**kwargs)


def hardware_from_dict(doc: Any, where: str = "hardware") -> Hardware:
    """A `Hardware` from its JSON form (plan.json's hardware_spec); errors name the field."""
    return _build(Hardware, doc, where)


def resolve_hardware(name_or_path: str) -> Hardware:
    """A preset name, or a JSON/YAML file with the fields of `Hardware`."""
    if Path(name_or_path).suffix in (".json", ".yaml", ".yml"):
        doc = read_mapping(name_or_path)
        doc.setdefault("name", Path(name_or_path).stem)
        return hardware_from_dict(doc, str(name_or_path))
    return get_hardware(name_or_path)
