"""Reading VLM annotation files, keeping each record's line number for error reports.

Inputs: a LLaVA-style JSON list, a JSONL file (one record per line), or an InternVL meta JSON
{"name": {"root": image folder, "annotation": file.jsonl, "repeat_time"?, "max_dynamic_patch"?,
...}} naming several such files (data/inputs.py also reads Megatron-Energon datasets).
Relative paths in a meta file are resolved against the meta file's folder (InternVL resolves
them against the working directory; absolute paths, the usual case, mean the same in both).
"""

from __future__ import annotations

import bisect
import codecs
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_omnibal.data.formats.raw import RawRecord
from megatron_omnibal.data.formats.sample_files import FolderFiles, SampleFiles


@dataclass(frozen=True)
class DatasetSpec:
    """One annotation file and how the training loader uses it."""

    name: str
    annotation: Path
    image_root: Path
    repeat_time: float = 1.0
    max_tiles: int | None = None  # InternVL's per-dataset max_dynamic_patch

    @property
    def repeats(self) -> int:
        """Passes over the records per epoch (a fraction keeps a part once, see read_records)."""
        return int(self.repeat_time) if self.repeat_time > 1 else 1

    def records(self) -> list[RawRecord]:
        """All records in file order (a fractional repeat_time keeps the first part)."""
        if self.annotation.suffix == ".jsonl":
            records = _jsonl_records(self.annotation)
        else:
            records = _json_list_records(self.annotation)
        if self.repeat_time < 1:
            records = records[:int(len(records) * self.repeat_time)]
        return records

    def record_table(self) -> Sequence[RawRecord]:
        """The records as `records()` gives them, compact where the format allows: a JSONL
        file's as byte offsets (JsonlRecords, 8 bytes a record, each line read back when asked
        for), so that a rank holding millions of records does not hold them as objects."""
        if self.annotation.suffix != ".jsonl":
            return self.records()
        table = JsonlRecords.scan(self.annotation)
        if self.repeat_time < 1:
            table = table.head(int(len(table) * self.repeat_time))
        return table

    def files(self) -> SampleFiles:
        """The records with their images (files under image_root)."""
        return FolderFiles(self.image_root)


def read_annotations(path: str | os.PathLike, image_root: str | os.PathLike | None = None
                     ) -> tuple[list[DatasetSpec], bool]:
    """The datasets an annotation file names (a JSON list, JSONL, or an InternVL meta JSON
    naming several), and whether it was a meta file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such dataset file")
    if path.suffix == ".jsonl":
        return [DatasetSpec(path.stem, path, Path(image_root or path.parent))], False
    with open(path, "rb") as fh:
        first = fh.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()[:1]
    if first == b"[":
        return [DatasetSpec(path.stem, path, Path(image_root or path.parent))], False
    if first != b"{":
        raise ValueError(f"{path}: expected a JSON list of samples, JSONL or an InternVL meta "
                         "JSON object")
    try:
        meta = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
    if image_root is not None:
        raise ValueError(f"{path}: --image-root does not apply to a meta file (each entry has "
                         "its own 'root')")
    return [_meta_entry(path, name, entry) for name, entry in meta.items()], True


def _meta_entry(path: Path, name: str, entry: object) -> DatasetSpec:
    if not isinstance(entry, dict) or "annotation" not in entry or "root" not in entry:
        raise ValueError(f"{path}: dataset '{name}' needs 'root' and 'annotation'")
    root, annotation = str(entry["root"]), str(entry["annotation"])
    for key, value in (("root", root), ("annotation", annotation)):
        if "://" in value:
            raise ValueError(f"{path}: dataset '{name}': remote {key} {value!r} is not "
                             "supported (only local files)")
    repeat = checked_repeat(entry.get("repeat_time", 1), f"{path}: dataset '{name}': "
                            "repeat_time")
    max_tiles = entry.get("max_dynamic_patch")
    if max_tiles is not None and (isinstance(max_tiles, bool) or not isinstance(max_tiles, int)
                                  or max_tiles < 1):
        raise ValueError(f"{path}: dataset '{name}': max_dynamic_patch must be a positive "
                         f"integer, got {max_tiles!r}")
    base = path.parent
    ann = Path(annotation) if os.path.isabs(annotation) else base / annotation
    if not ann.is_file():
        raise FileNotFoundError(f"{path}: dataset '{name}': annotation {ann} not found")
    return DatasetSpec(str(name), ann, Path(root) if os.path.isabs(root) else base / root,
                       repeat, max_tiles)


def checked_repeat(value: object, what: str) -> float:
    """Passes over a dataset per epoch: a fraction in (0, 1] (its first part) or a whole
    number; `what` names the setting in the error."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0 or (
            value > 1 and not float(value).is_integer()):
        raise ValueError(f"{what} must be a fraction in (0, 1] or a whole number, got "
                         f"{value!r}")
    return float(value)


def read_records(spec: DatasetSpec) -> list[RawRecord]:
    """All records of a dataset in its order (a fractional repeat_time keeps the first part)."""
    return spec.records()


def chunks(records: list[RawRecord], size: int) -> Iterator[list[RawRecord]]:
    for start in range(0, len(records), size):
        yield records[start:start + size]


def _jsonl_records(path: Path) -> list[RawRecord]:
    with open(path, encoding="utf-8-sig") as fh:
        return [RawRecord(i, i + 1, line) for i, line in enumerate(fh)]


SCAN_BYTES = 1 << 24  # bytes read at a time while indexing a JSONL file


class JsonlRecords(Sequence):
    """A JSONL file's records as the byte offsets of their lines: record k is line k + 1, read
    back (os.pread: no shared file position between the DataLoader's forked workers) and
    decoded as `_jsonl_records` reads it (UTF-8, a leading byte-order mark dropped, a line's
    `\r\n` read as `\n`)."""

    def __init__(self, path: Path, starts: np.ndarray) -> None:
        self.path = Path(path)
        self.starts = starts  # int64, one more than the records: the last is the file's end
        self._fd: tuple[int, int] | None = None  # (pid, fd)

    @classmethod
    def scan(cls, path: Path) -> JsonlRecords:
        """Index `path` in one pass over its bytes (checked as UTF-8 on the way, as reading it
        as text would check it). A file with a lone carriage return (a line break text mode
        reads, a byte scan for newlines does not) is refused rather than split otherwise."""
        breaks, size, bom, carried = [], 0, b"", False
        decoder = codecs.getincrementaldecoder("utf-8")()
        with open(path, "rb") as fh:
            while chunk := fh.read(SCAN_BYTES):
                if size == 0:
                    bom = chunk[:3] if chunk.startswith(codecs.BOM_UTF8) else b""
                try:
                    decoder.decode(chunk)
                except UnicodeDecodeError as exc:
                    raise ValueError(f"{path}: not UTF-8 at byte {size + exc.start}: "
                                     f"{exc.reason}") from exc
                if chunk.count(b"\r") != chunk.count(b"\r\n") + chunk.endswith(b"\r") or (
                        carried and not chunk.startswith(b"\n")):
                    _lone_return(path, size)
                carried = chunk.endswith(b"\r")
                found = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 0x0A)
                breaks.append(found.astype(np.int64) + (size + 1))
                size += len(chunk)
        if carried:
            _lone_return(path, size)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: not UTF-8 at its end: {exc.reason}") from exc
        ends = np.concatenate([np.zeros(0, np.int64), *breaks])
        if size and (len(ends) == 0 or ends[-1] != size):
            ends = np.append(ends, size)  # a last line without its newline
        return cls(path, np.concatenate([[len(bom)], ends]).astype(np.int64)
                   if size > len(bom) else np.full(1, len(bom), np.int64))

    def head(self, count: int) -> JsonlRecords:
        """The first `count` records."""
        return JsonlRecords(self.path, self.starts[:count + 1])

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, k):  # noqa: ANN001 - an int or a slice, as a list takes them
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        if not -len(self) <= k < len(self):
            raise IndexError(f"{self.path}: record {k} of {len(self)}")
        k = k % len(self)
        start, end = int(self.starts[k]), int(self.starts[k + 1])
        data = os.pread(self._descriptor(), end - start, start).decode("utf-8")
        if data.endswith("\r\n"):
            data = data[:-2] + "\n"
        return RawRecord(k, k + 1, data)

    def _descriptor(self) -> int:
        if self._fd is None or self._fd[0] != os.getpid():
            self._fd = (os.getpid(), os.open(self.path, os.O_RDONLY))
        return self._fd[1]

    def __getstate__(self) -> dict:
        return {"path": self.path, "starts": self.starts, "_fd": None}


def _lone_return(path: Path, at: int) -> None:
    raise ValueError(f"{path}: a carriage return without a newline near byte {at} (text mode "
                     "reads it as a line break, the record index does not): use \\n or "
                     "\\r\\n line ends")


def _json_list_records(path: Path) -> list[RawRecord]:
    """Decode the list element by element so each record keeps its starting line."""
    text = path.read_text(encoding="utf-8-sig")
    decoder = json.JSONDecoder()
    newlines = _newline_offsets(text)
    pos = _skip_ws(text, 0)
    if pos >= len(text) or text[pos] != "[":
        raise ValueError(f"{path}: expected a JSON list of samples")
    pos = _skip_ws(text, pos + 1)
    records: list[RawRecord] = []
    if pos < len(text) and text[pos] == "]":
        return records
    while True:
        line = bisect.bisect_left(newlines, pos) + 1
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {exc.lineno}: invalid JSON in record "
                             f"{len(records)}: {exc.msg}") from exc
        records.append(RawRecord(len(records), line, obj))
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_ws(text, pos + 1)
            continue
        if pos < len(text) and text[pos] == "]":
            return records
        line = bisect.bisect_left(newlines, pos) + 1
        raise ValueError(f"{path}: line {line}: expected ',' or ']' after record "
                         f"{len(records) - 1}")


def _skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _newline_offsets(text: str) -> list[int]:
    out, pos = [], text.find("\n")
    while pos >= 0:
        out.append(pos)
        pos = text.find("\n", pos + 1)
    return out
