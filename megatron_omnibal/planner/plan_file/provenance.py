"""Which length file (and layer profile) a plan was made from, by path and SHA-256 digest.

A plan's predictions hold only for the samples it drew its micro-batches from: `omnibal
simulate` and the Megatron side re-read that file and refuse it when it is missing or no longer
what the plan saw, instead of silently predicting (or training) on other data. The lengths are
digested by content (the per-sample arrays), so the same lengths in another format (JSON list,
JSONL, .npz) still match, and a meta file's referenced files are covered. A measured layer
profile is digested by content too. The shipped example lengths are used only when asked for
by name.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from megatron_omnibal.data.lengths import LengthsError, LengthStats, load_lengths

EXAMPLE_NAME = "example"
EXAMPLE_LENGTHS = Path(__file__).resolve().parents[3] / "examples" / "data" / "internvl_subset.npz"


def lengths_sha256(stats: LengthStats) -> str:
    """Digest of the samples' vit_num, token_num and image_flags, in sample order."""
    digest = hashlib.sha256(b"omnibal-lengths-v1")
    for values in (stats.vit, stats.tokens, stats.image_flags):
        digest.update(np.ascontiguousarray(values, dtype="<i8").tobytes())
    return digest.hexdigest()


def lengths_path(name_or_path: str) -> Path:
    """`example` -> the shipped InternVL subset; anything else is a path."""
    return EXAMPLE_LENGTHS if name_or_path == EXAMPLE_NAME else Path(name_or_path)


def load_named_lengths(name_or_path: str, flag: str = "--lengths") -> tuple[LengthStats, Path]:
    """Length statistics and their resolved path; errors name the flag and the file."""
    path = lengths_path(name_or_path)
    try:
        return load_lengths(path), path.resolve()
    except LengthsError as exc:
        raise ValueError(f"{flag} {name_or_path}: {exc}") from exc


def _recorded(path: str | Path, where: str, what: str, flag: str) -> Path:
    """A file a plan recorded; refused if it is gone, naming the flag that gives its new place."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(
            f"{where} was made from the {what} {path}, which does not exist (any more); "
            f"give its new location with {flag}"
        )
    return path


def load_recorded_lengths(path: str | Path, sha256: str, where: str) -> LengthStats:
    """The length file a plan recorded, refused if missing or changed since (`where`: the plan)."""
    path = _recorded(path, where, "length file", "--lengths")
    try:
        stats = load_lengths(path)
    except LengthsError as exc:
        raise ValueError(f"{where}: its length file: {exc}") from exc
    found = lengths_sha256(stats)
    if found != sha256:
        raise ValueError(
            f"{where} was made from other lengths than {path} now holds (SHA-256 of the "
            f"lengths {found[:12]}.., the plan recorded {sha256[:12]}..); re-plan on this file"
        )
    return stats


def profile_sha256(doc: dict) -> str:
    """Digest of a layer profile's content (canonical JSON: key order and spacing ignored)."""
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def load_recorded_profile(path: str | Path, sha256: str, where: str) -> dict:
    """The layer profile a plan recorded, refused if missing or changed since."""
    from megatron_omnibal.models.resolve import read_mapping

    path = _recorded(path, where, "layer profile", "--profile")
    doc = read_mapping(path)
    if profile_sha256(doc) != sha256:
        raise ValueError(f"{where} was made from another layer profile than {path} now holds")
    return doc
