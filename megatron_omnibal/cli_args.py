"""argparse types for `omnibal` and `--omnibal*` flags: numbers in range, output paths that can
be written.

Checked by the parser, so a bad value exits with status 2 and a message naming the flag before
any work starts (a plan search or a profile run should not end in "cannot write --out"). Output
files are written exactly where the flag says: a flag whose format is fixed by the file name
(.npz, .png) refuses another name instead of renaming it.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

# The largest integer flag: counts, sizes, budgets and seeds all fit a C int32 and their sums an
# int64, so no value reaches the C++ core as an overflow or a pybind TypeError.
MAX_INT = 2**31 - 1


def _number(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if kind is int and value > MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_INT}, got {text}")
    return value


def _in_range(text: str, kind: type, accepts: Callable[[float], bool], rule: str) -> int | float:
    """`text` as a number of `kind` that `accepts`; else an error: "`rule`, got `text`"."""
    value = _number(text, kind)
    if not accepts(value):
        raise argparse.ArgumentTypeError(f"{rule}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _in_range(text, int, lambda v: v >= 1, "must be a positive integer")


def non_negative_int(text: str) -> int:
    return _in_range(text, int, lambda v: v >= 0, "must be >= 0")


def positive_float(text: str) -> float:
    return _in_range(text, float, lambda v: v > 0, "must be > 0")


def non_negative_float(text: str) -> float:
    return _in_range(text, float, lambda v: v >= 0, "must be >= 0")


def fraction(text: str) -> float:
    """A share in [0, 1]."""
    return _in_range(text, float, lambda v: 0 <= v <= 1, "must lie in [0, 1]")


def counts(text: str) -> list[int]:
    """Comma-separated counts >= 0, one per pipeline stage (e.g. layers: 30,15,0,0)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 30,15,0,0, got {text!r}"
        ) from None
    if any(not 0 <= v <= MAX_INT for v in values):
        raise argparse.ArgumentTypeError(f"counts must lie in [0, {MAX_INT}], got {text!r}")
    return values


def pack_cost(text: str) -> str:
    """'A,B,C': the modeled time of a pack (ms per tile, per token, per squared token), checked
    here and kept as text (Megatron pickles its args into checkpoints)."""
    from megatron_omnibal.balance.config import PackCost

    try:
        PackCost.parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected three finite numbers A,B,C >= 0, not all 0, got {text!r}"
        ) from None
    return text


def _cannot_write(path: Path) -> str | None:
    """Why `path` cannot be written, found by trying (permission bits say nothing to root, or on
    a read-only or special file system); None if it can. A file created to try is removed."""
    try:
        if path.exists():
            with open(path, "ab"):
                pass
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            path.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _check_directory(directory: Path, text: str) -> None:
    """`directory` exists or can be created (mkdir -p), and files can be written in it."""
    existing = directory
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {existing} is not a directory")
    reason = _cannot_write(existing / f".omnibal-write-check-{os.getpid()}")
    if reason:
        raise argparse.ArgumentTypeError(f"{text}: cannot write in {existing} ({reason})")


def _check_file(text: str, create_parent: bool) -> str:
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, expected a file to write")
    if create_parent:
        _check_directory(path.parent, text)
    elif not path.parent.is_dir():
        problem = "is not a directory" if path.parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"{text}: directory {path.parent} {problem}")
    reason = _cannot_write(path) if path.parent.is_dir() else None
    if reason:
        raise argparse.ArgumentTypeError(f"{text}: cannot write ({reason})")
    return text


def output_file(text: str) -> str:
    """A file we can create or overwrite: not a directory, in an existing writable directory."""
    return _check_file(text, create_parent=False)


def output_file_type(*suffixes: str, create_parent: bool = False) -> Callable[[str], str]:
    """An argparse type like output_file. suffixes: the format the name decides (.npz, .png);
    another suffix is refused, never appended. create_parent: the file's directory may be
    missing, for a command that creates it."""
    names = " or ".join(suffixes)

    def check(text: str) -> str:
        path = Path(text)
        if suffixes and not path.is_dir() and path.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text}: expected a file name ending in {names}")
        return _check_file(text, create_parent)

    return check


png_file = output_file_type(".png")


def output_dir(text: str) -> str:
    """A directory we can create or write into: not a file, under a writable directory."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    _check_directory(path, text)
    return text
