"""Length statistics I/O: every format, validation errors that name file and record."""

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.data.lengths import (
    LengthsError,
    concat,
    from_arrays,
    load_lengths,
    save_lengths,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "internvl_subset.npz"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


def _records(n, rng):
    vit = rng.integers(1, 6, n)
    return [{"vit_num": int(v), "token_num": int(rng.integers(256 * v + 1, 256 * v + 900)),
             "image_flags": int(rng.integers(0, v + 1))} for v in vit]


def test_json_list_jsonl_and_npz_round_trip(tmp_path):
    recs = _records(50, np.random.default_rng(0))
    (tmp_path / "a.json").write_text(json.dumps(recs))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    a = load_lengths(tmp_path / "a.json")
    b = load_lengths(tmp_path / "a.jsonl")
    save_lengths(a, tmp_path / "a.npz")
    c = load_lengths(tmp_path / "a.npz")
    for s in (a, b, c):
        assert s.vit.tolist() == [r["vit_num"] for r in recs]
        assert s.tokens.tolist() == [r["token_num"] for r in recs]
        assert s.image_flags.tolist() == [r["image_flags"] for r in recs]


def test_cache_is_used_and_invalidated(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"vit_num": 1, "token_num": 5, "image_flags": 1}]))
    assert load_lengths(path).tokens.tolist() == [5]
    assert list((tmp_path / "cache").glob("*.npz"))
    path.write_text(json.dumps([{"vit_num": 2, "token_num": 7, "image_flag": 0}] * 2))
    assert load_lengths(path).tokens.tolist() == [7, 7]


def test_meta_file_concatenates_in_order_and_names_datasets(tmp_path):
    rng = np.random.default_rng(1)
    r1, r2 = _records(3, rng), _records(4, rng)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "one.json").write_text(json.dumps(r1))
    (tmp_path / "d" / "two.jsonl").write_text("\n".join(json.dumps(r) for r in r2))
    meta = {"first": {"token_lengths": "d/one.json"}, "second": {"token_lengths": "d/two.jsonl"}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    s = load_lengths(tmp_path / "meta.json")
    assert s.tokens.tolist() == [r["token_num"] for r in r1 + r2]
    assert s.names == ("first", "second")
    assert s.dataset.tolist() == [0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"token_num": 5, "image_flags": 0}, "missing field 'vit_num'"),
        ({"vit_num": 1, "image_flags": 0}, "missing field 'token_num'"),
        ({"vit_num": 1, "token_num": 5}, "missing field 'image_flags' or 'image_flag'"),
        ({"vit_num": -1, "token_num": 5, "image_flags": 0}, "'vit_num' is negative"),
        ({"vit_num": 1, "token_num": 0, "image_flags": 0}, "'token_num' must be positive"),
        ({"vit_num": 1.5, "token_num": 5, "image_flags": 0}, "'vit_num' must be an integer"),
        ({"vit_num": 1, "token_num": "9", "image_flags": 0}, "'token_num' must be an integer"),
        ({"vit_num": 1, "token_num": 9, "image_flags": 2}, "exceeds 'vit_num'"),
    ],
)
def test_bad_record_names_file_and_index(tmp_path, record, message):
    good = {"vit_num": 1, "token_num": 5, "image_flags": 1}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([good, good, record]))
    with pytest.raises(LengthsError) as err:
        load_lengths(path)
    assert str(path) in str(err.value)
    assert "record 2" in str(err.value)
    assert message in str(err.value)


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(LengthsError, match="no such"):
        load_lengths(tmp_path / "missing.json")
    (tmp_path / "broken.jsonl").write_text('{"vit_num": 1, "token_num": 3, "image_flags": 1}\n{')
    with pytest.raises(LengthsError, match=r"line 2 \(record 1\)"):
        load_lengths(tmp_path / "broken.jsonl")
    (tmp_path / "meta.json").write_text(json.dumps({"x": {"token_lengths": "nope.json"}}))
    with pytest.raises(LengthsError, match="dataset 'x'.*not found"):
        load_lengths(tmp_path / "meta.json")


def test_shipped_example_matches_its_readme():
    s = load_lengths(EXAMPLE)
    assert len(s) == 70706
    assert s.names == ("ai2d", "docvqa", "chartqa", "synthdog_en")
    assert np.bincount(s.dataset).tolist() == [12413, 10211, 18317, 29765]
    assert (s.vit.min(), s.vit.max(), s.tokens.min(), s.tokens.max()) == (1, 5, 293, 2538)


def test_from_arrays_and_concat_validate():
    a = from_arrays([1, 2], [300, 600], names=("a",))
    b = from_arrays([3], [900], [0], names=("b",))
    c = concat([a, b])
    assert c.dataset.tolist() == [0, 0, 1] and c.names == ("a", "b")
    assert len(c.repeat(3)) == 9
    with pytest.raises(LengthsError, match="record 1"):
        from_arrays([1, 1], [5, -5])
