"""The record index of a real data source against the list of (dataset, record) pairs it
replaces: same records in the same order, with repeats and skipped records."""

from __future__ import annotations

from megatron_omnibal.data.formats.annotations import DatasetSpec
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


def test_one_rank_builds_the_index_and_the_others_map_it(tmp_path, monkeypatch):
    """Oracle: the list of (dataset, record) pairs. Local rank 0 scans the JSONL files and
    writes the index (node_plans.node_arrays); a rank that started first waits, maps the same
    arrays read-only and reads each record back from the files without scanning them; a JSON
    list's table, which has no offsets, it makes itself."""
    import json
    import threading

    import numpy as np

    from megatron_omnibal.data.formats.annotations import JsonlRecords
    from megatron_omnibal.megatron.stream import node_plans

    specs = []
    for name, count, repeat in (("a", 6, 1.0), ("b", 4, 2.0)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(f'{{"id": "{name}{i}"}}\n' for i in range(count)))
        specs.append(DatasetSpec(name, path, tmp_path, repeat_time=repeat))
    listed = tmp_path / "c.json"
    listed.write_text(json.dumps([{"id": f"c{i}"} for i in range(3)]))
    specs.append(DatasetSpec("c", listed, tmp_path))
    skipped = {1: {3}}
    want = [(d, r) for d, spec in enumerate(specs)
            for r in [r for r in spec.records() if r.index not in skipped.get(d, ())]
            * spec.repeats]
    scans = []
    scan = JsonlRecords.scan.__func__
    monkeypatch.setattr(JsonlRecords, "scan",
                        classmethod(lambda cls, path: scans.append(path) or scan(cls, path)))

    def opened(local_rank: int) -> RecordIndex:
        arrays, meta = node_plans.node_arrays(
            lambda: RecordIndex.build([s.record_table() for s in specs],
                                      [s.repeats for s in specs], skipped).to_arrays(),
            "record-index", {"k": 1}, local_rank=local_rank, folder=tmp_path / "shm")
        return RecordIndex.from_arrays(arrays, meta, lambda d: specs[d].record_table())

    (tmp_path / "shm").mkdir()
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("r", opened(1)))
    reader.start()
    mine = opened(0)
    reader.join()
    assert sorted(scans) == [specs[0].annotation, specs[1].annotation]  # by the writer only
    for index in (mine, got["r"]):
        assert list(index) == want
        assert isinstance(index.row, np.memmap) and not index.row.flags.writeable
        assert isinstance(index.tables[0], JsonlRecords)
        assert not index.tables[0].starts.flags.writeable
    assert [p.name.split("-")[:3] for p in (tmp_path / "shm").iterdir()] == [
        ["omnibal", "record", "index"]]
