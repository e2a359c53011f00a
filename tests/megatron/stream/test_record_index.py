"""The record index of a real data source against the list of (dataset, record) pairs it
replaces: same records in the same order, with repeats and skipped records."""

from __future__ import annotations

from megatron_omnibal.data.annotations import DatasetSpec
from megatron_omnibal.megatron.stream.record_index import RecordIndex


def test_index_equals_the_list(tmp_path):
    specs = []
    for name, count, repeat in (("a", 7, 1.0), ("b", 5, 3.0), ("c", 4, 1.0)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(f'{{"id": "{name}{i}"}}\n' for i in range(count)))
        specs.append(DatasetSpec(name, path, tmp_path, repeat_time=repeat))
    skipped = {0: {2, 6}, 1: {0}}
    want = [(d, r) for d, spec in enumerate(specs)
            for r in [r for r in spec.records() if r.index not in skipped.get(d, ())]
            * spec.repeats]
    index = RecordIndex.build([s.record_table() for s in specs], [s.repeats for s in specs],
                              skipped)
    assert len(index) == len(want) == 5 + 4 * 3 + 4
    assert list(index) == want
    assert index.per_dataset().tolist() == [5, 12, 4]
