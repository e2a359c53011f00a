"""Which annotation record each length record is: the index a real data source looks samples
up in, kept as two arrays.

A length file lists its datasets' records in order, each dataset's records `repeats` times,
without the records `omnibal stats` skipped. Held as a list of (dataset, record) pairs, that
is a tuple, a record and its JSONL line's text per sample on every rank (about 600 bytes:
gigabytes at 12 million samples). Here it is the dataset and the record's place in its
dataset's table (int16 + int32 per sample, wider only where the counts need it) over the
tables themselves (a JSONL file's: byte offsets, data/annotations.JsonlRecords), and a record
is built when a sample asks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from megatron_omnibal.data.formats.annotations import JsonlRecords
from megatron_omnibal.data.formats.raw import RawRecord


class RecordIndex:
    """`index[i] -> (dataset, RawRecord)` of length record i; `len(index)` length records."""

    def __init__(self, tables: list[Sequence[RawRecord]], dataset: np.ndarray,
                 row: np.ndarray) -> None:
        self.tables = tables
        self.dataset = dataset  # the dataset of each length record
        self.row = row  # its record's place in that dataset's table

    @classmethod
    def build(cls, tables: list[Sequence[RawRecord]], repeats: list[int],
              skipped: Mapping[int, set[int]]) -> RecordIndex:
        """The length records of `tables` (one per dataset, in order): each table's records
        whose `index` is not in `skipped[dataset]`, `repeats[dataset]` times over."""
        datasets, rows = [], []
        d_type = np.int16 if len(tables) < 2**15 else np.int32
        r_type = np.int32 if max(map(len, tables), default=0) < 2**31 else np.int64
        for d, (table, repeat) in enumerate(zip(tables, repeats, strict=True)):
            keep = np.arange(len(table), dtype=r_type)
            drop = skipped.get(d)
            if drop:
                keep = np.setdiff1d(keep, np.fromiter(drop, r_type, len(drop)),
                                    assume_unique=True)
            rows.append(np.tile(keep, repeat))
            datasets.append(np.full(len(keep) * repeat, d, d_type))
        return cls(tables, np.concatenate([np.zeros(0, d_type), *datasets]),
                   np.concatenate([np.zeros(0, r_type), *rows]))

    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict]:
        """The index as arrays, a JSONL file's table as its line offsets ("starts<d>"), and
        the meta that names those files: what one rank writes for the others of its node
        (node_plans.node_arrays)."""
        arrays = {"dataset": self.dataset, "row": self.row}
        jsonl = {}
        for d, table in enumerate(self.tables):
            if isinstance(table, JsonlRecords):
                arrays[f"starts{d}"] = table.starts
                jsonl[str(d)] = str(table.path)
        return arrays, {"tables": len(self.tables), "jsonl": jsonl}

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], meta: dict,
                    table_of: Callable[[int], Sequence[RawRecord]]) -> RecordIndex:
        """The index `to_arrays` gave; `table_of(d)` makes dataset d's table where it was not
        a JSONL file's offsets."""
        jsonl = meta["jsonl"]
        tables = [JsonlRecords(Path(jsonl[str(d)]), arrays[f"starts{d}"]) if str(d) in jsonl
                  else table_of(d) for d in range(meta["tables"])]
        return cls(tables, arrays["dataset"], arrays["row"])

    def per_dataset(self) -> np.ndarray:
        """Length records per dataset."""
        return np.bincount(self.dataset, minlength=len(self.tables))

    def __len__(self) -> int:
        return len(self.row)

    def __getitem__(self, i: int) -> tuple[int, RawRecord]:
        d = int(self.dataset[i])
        return d, self.tables[d][int(self.row[i])]

    def __iter__(self) -> Iterator[tuple[int, RawRecord]]:
        return (self[i] for i in range(len(self)))
