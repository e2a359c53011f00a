"""The files of a Hugging Face checkpoint directory that its data side reads: config.json, the
image and video preprocessor configs, whether it has a tokenizer and a chat template of its own;
and the readers of a processor's entries (square tile sides, per-channel colours)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


@dataclass(frozen=True, kw_only=True)
class HFFiles:
    """A checkpoint directory's data-side files, read once (an absent file is {})."""

    path: Path
    config: dict[str, Any]
    preprocessor: dict[str, Any]
    video: dict[str, Any]
    has_tokenizer: bool
    chat_template: bool

    @property
    def model_type(self) -> Any:
        return self.config.get("model_type")


def read_hf_files(path: Path) -> HFFiles:
    config = _json(path / "config.json", required=True)
    tokenizer_config = _json(path / "tokenizer_config.json")
    return HFFiles(path=path, config=config, preprocessor=_json(path / "preprocessor_config.json"),
                   video=_json(path / "video_preprocessor_config.json"),
                   has_tokenizer=any((path / f).is_file() for f in TOKENIZER_FILES),
                   chat_template=bool(tokenizer_config.get("chat_template"))
                   or any((path / f).is_file() for f in CHAT_TEMPLATE_FILES))  # fmt: skip


def _json(path: Path, required: bool = False) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ValueError(f"{path.parent}: no config.json (not a Hugging Face checkpoint)")
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot parse ({exc})") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return doc


def square_side(value: Any, default: int) -> int:
    """A square tile side from an image processor's size / crop_size entry."""
    if value is None:
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        sides = {value.get("height"), value.get("width")} - {None}
        if len(sides) == 1:
            return int(sides.pop())
        if "shortest_edge" in value:
            return int(value["shortest_edge"])
    raise ValueError(f"image size {value!r}: expected square tiles")


def colour(pre: dict[str, Any], key: str, default: tuple[float, float, float] | None,
           where: str) -> tuple[float, float, float]:
    """A processor's per-channel mean or std (its default when the file `where` has none)."""
    value = pre.get(key, default)
    if not (isinstance(value, list | tuple) and len(value) == 3 and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value)):
        raise ValueError(f"{where}: {key} {value!r} is not three numbers (R, G, B)")
    return tuple(float(v) for v in value)
