"""Frozen dataclasses <-> JSON, field by field, with errors that name the field.

plan.json is read by the Megatron side before any process group exists, so a wrong type or a
misspelt key must stop with `file: stages[2].vit_layers: expected ...`, not a KeyError deep in a
model builder. Supported field types: int, float, bool, str, `X | None`, tuples of those
(`tuple[int, int]`, `tuple[int, ...]`), nested dataclasses and tuples of them.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any


class PlanError(ValueError):
    """A plan.json that cannot be used; the message names the file and the field."""


def need(cond: bool, msg: str) -> None:
    if not cond:
        raise PlanError(msg)


def to_json(obj: Any) -> Any:
    """A dataclass (or value) as JSON-ready data: tuples become lists, nested classes dicts."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_json(v) for v in obj]
    return obj


def from_json(
    cls: type, doc: Any, where: str, built: dict[str, Any] | None = None, path: str = ""
) -> Any:
    """Build dataclass `cls` from `doc`; messages name `where` (the file) and the field `path`.

    `built` holds fields the caller has already read with their own validating reader.
    """
    at = f"{where}: {path}" if path else where
    if not isinstance(doc, dict):
        raise PlanError(f"{at}: expected an object, got {type(doc).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in doc:
        if key not in fields:
            raise PlanError(f"{at}: unknown field '{key}' (known: {', '.join(fields)})")
    kwargs = dict(built or {})
    for name, f in fields.items():
        if name in kwargs:
            continue
        if name not in doc:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanError(f"{at}: missing field '{name}'")
            continue
        sub = f"{path}.{name}" if path else name
        kwargs[name] = _value(hints[name], doc[name], where, sub)
    try:
        return cls(**kwargs)
    except ValueError as exc:  # PlanError, or a class's own check (balance's Level, PackCost)
        raise PlanError(f"{at}: {exc}") from None


def _value(kind: Any, value: Any, where: str, path: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    at = f"{where}: {path}"
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, value, where, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise PlanError(f"{at}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_value(args[0], v, where, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise PlanError(f"{at}: expected {len(args)} values, got {value!r}")
        return tuple(
            _value(a, v, where, f"{path}[{i}]")
            for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if dataclasses.is_dataclass(kind):
        return from_json(kind, value, where, path=path)
    if kind is bool:
        if not isinstance(value, bool):
            raise PlanError(f"{at}: expected true or false, got {value!r}")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(f"{at}: expected an integer, got {value!r}")
    elif kind is float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise PlanError(f"{at}: expected a number, got {value!r}")
        value = float(value)
    elif kind is str:
        if not isinstance(value, str):
            raise PlanError(f"{at}: expected a string, got {value!r}")
    else:  # pragma: no cover - a field type this reader was not taught
        raise TypeError(f"{at}: unsupported field type {kind!r}")
    return value
