"""The compact JSONL record table (byte offsets) against the list the text reader makes."""

from __future__ import annotations

import codecs
import pickle

import pytest

from megatron_omnibal.data.formats import annotations
from megatron_omnibal.data.formats.annotations import DatasetSpec, JsonlRecords, _jsonl_records


@pytest.mark.parametrize("bom", [b"", codecs.BOM_UTF8])
@pytest.mark.parametrize("end", [b"\n", b"\r\n"])
@pytest.mark.parametrize("last", [b"", b"\n"])
def test_same_records_as_the_text_reader(tmp_path, monkeypatch, bom, end, last):
    """Every record (index, line, text) equal to _jsonl_records', with a byte-order mark,
    CRLF line ends, a blank line, non-ASCII text and a last line with or without its newline;
    scanned in chunks smaller than a line, so records straddle them."""
    monkeypatch.setattr(annotations, "SCAN_BYTES", 7)
    lines = [b'{"id": 1, "text": "caf\xc3\xa9"}', b"", b'{"id": 2}', b"   ",
             b'{"id": "\xe2\x82\xac"}']
    path = tmp_path / "a.jsonl"
    path.write_bytes(bom + end.join(lines) + last.replace(b"\n", end))
    want = _jsonl_records(path)
    got = JsonlRecords.scan(path)
    assert len(got) == len(want) == len(lines)
    assert list(got) == want
    assert got[-1] == want[-1] and got[1:3] == want[1:3]
    assert pickle.loads(pickle.dumps(got))[4] == want[4]  # to DataLoader workers
    with pytest.raises(IndexError):
        got[len(lines)]


def test_fraction_and_refusals(tmp_path):
    """A fractional repeat_time keeps the first part, as records() does; an empty file has no
    records; a lone carriage return and bytes that are not UTF-8 are errors naming the file."""
    path = tmp_path / "b.jsonl"
    path.write_text("".join(f'{{"id": {i}}}\n' for i in range(10)))
    spec = DatasetSpec("b", path, tmp_path, repeat_time=0.35)
    assert list(spec.record_table()) == spec.records() and len(spec.records()) == 3
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert len(JsonlRecords.scan(tmp_path / "empty.jsonl")) == 0
    (tmp_path / "cr.jsonl").write_bytes(b'{"id": 1}\r{"id": 2}\n')
    with pytest.raises(ValueError, match="cr.jsonl: a carriage return"):
        JsonlRecords.scan(tmp_path / "cr.jsonl")
    (tmp_path / "bad.jsonl").write_bytes(b'{"id": "\xff"}\n')
    with pytest.raises(ValueError, match="bad.jsonl: not UTF-8 at byte 8"):
        JsonlRecords.scan(tmp_path / "bad.jsonl")
