"""A record as read from its file, before parsing: the one type every format's reader yields
and every sample source parses, so `omnibal stats` and the training loader agree."""

from __future__ import annotations

import json
from dataclasses import dataclass

from megatron_omnibal.data.text.conversations import SampleError


@dataclass(frozen=True)
class RawRecord:
    """A record before parsing: JSON text (JSONL) or an already parsed object (JSON list)."""

    index: int  # position in the annotation file (0-based)
    line: int  # 1-based line where the record starts
    data: str | object


def parse_record(raw: RawRecord) -> dict:
    """The record's JSON object; one parser so `omnibal stats` and the training loader agree."""
    data = raw.data
    if isinstance(data, str):
        if not data.strip():
            raise SampleError("empty line")
        try:
            data = json.loads(data)
        except json.JSONDecodeError as exc:
            raise SampleError(f"invalid JSON: {exc.msg} (column {exc.colno})") from exc
    if not isinstance(data, dict):
        raise SampleError(f"expected a JSON object, got {type(data).__name__}")
    return data
