"""Image headers against Pillow, and annotation reading (line numbers, meta files)."""

import io
import json

import pytest
from PIL import Image

from megatron_omnibal.data.formats.annotations import read_records
from megatron_omnibal.data.images.header import ImageHeaderError, image_size
from megatron_omnibal.data.inputs import read_inputs

SIZES = [(1, 1), (17, 400), (640, 480), (3001, 7), (1920, 1080)]


@pytest.mark.parametrize(("fmt", "mode", "extra"), [
    ("PNG", "RGB", {}), ("PNG", "L", {}), ("PNG", "RGBA", {}), ("JPEG", "RGB", {}),
    ("JPEG", "L", {}), ("JPEG", "RGB", {"progressive": True}), ("GIF", "P", {}),
    ("WEBP", "RGB", {}), ("BMP", "RGB", {}),
])
def test_header_size_matches_pillow(tmp_path, fmt, mode, extra):
    for k, (w, h) in enumerate(SIZES):
        path = tmp_path / f"{k}.{fmt.lower()}"
        Image.new(mode, (w, h)).save(path, fmt, **extra)
        with Image.open(path) as img:
            assert image_size(path) == img.size == (w, h)


def test_jpeg_with_large_exif_and_icc_segments(tmp_path):
    exif = Image.Exif()
    exif[0x010E] = "x" * 30000  # ImageDescription: a 30 kB APP1 segment before the frame
    path = tmp_path / "exif.jpg"
    Image.new("RGB", (321, 123)).save(path, "JPEG", exif=exif.tobytes(),
                                     icc_profile=b"\0" * 20000)
    assert path.stat().st_size > 50000
    assert image_size(path) == (321, 123)


def _jpeg_bytes(w, h):
    buf = io.BytesIO()
    Image.new("RGB", (w, h)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.mark.parametrize(("content", "message"), [
    (b"", "not a readable image"),
    (b"hello, not an image", "not a readable image"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "PNG without an IHDR"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF", "JPEG ends"),
    (b"\xff\xd8\xff\xd9", "before a start-of-frame"),
])
def test_corrupt_headers_are_named(tmp_path, content, message):
    path = tmp_path / "bad.img"
    path.write_bytes(content)
    with pytest.raises(ImageHeaderError, match=message) as err:
        image_size(path)
    assert str(path) in str(err.value)


def test_truncated_jpeg_header_and_missing_file(tmp_path):
    data = _jpeg_bytes(50, 60)
    sof = data.index(b"\xff\xc0")
    path = tmp_path / "cut.jpg"
    path.write_bytes(data[:sof + 5])
    with pytest.raises(ImageHeaderError, match="inside its start-of-frame"):
        image_size(path)
    path.write_bytes(data[:sof + 9])  # size bytes present: the header is readable
    assert image_size(path) == (50, 60)
    with pytest.raises(ImageHeaderError, match="No such file"):
        image_size(tmp_path / "missing.png")


def test_json_list_records_keep_their_lines(tmp_path):
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "x\n" * i}]}
            for i in range(7)]
    text = json.dumps(recs, indent=2)
    path = tmp_path / "data.json"
    path.write_text(text)
    (spec,), is_meta = read_inputs(path)
    assert not is_meta and spec.image_root == tmp_path and spec.name == "data"
    got = read_records(spec)
    assert [r.data for r in got] == recs
    lines = text.splitlines()
    for r in got:
        # the record's opening brace sits on its line; the id follows on the next
        assert lines[r.line - 1].strip() == "{"
        assert f'"id": "r{r.index}"' in lines[r.line]


def test_byte_order_mark_is_accepted(tmp_path):
    recs = [{"id": 1}, {"id": 2}]
    (tmp_path / "bom.json").write_text("\ufeff" + json.dumps(recs), encoding="utf-8")
    (tmp_path / "bom.jsonl").write_text("\ufeff" + "\n".join(map(json.dumps, recs)),
                                        encoding="utf-8")
    assert [r.data for r in read_records(read_inputs(tmp_path / "bom.json")[0][0])] == recs
    lines = read_records(read_inputs(tmp_path / "bom.jsonl")[0][0])
    assert [json.loads(r.data) for r in lines] == recs


def test_json_list_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n{"id": 1},\n{"id": 2}\n{"id": 3}\n]')
    with pytest.raises(ValueError, match=r"line 4: expected ',' or '\]' after record 1"):
        read_records(read_inputs(path)[0][0])
    path.write_text('[\n{"id": 1},\n{"id": \n]')
    with pytest.raises(ValueError, match="line 4: invalid JSON in record 1"):
        read_records(read_inputs(path)[0][0])


def test_meta_file_entries_and_checks(tmp_path):
    (tmp_path / "a.jsonl").write_text("".join(f'{{"id": {i}}}\n' for i in range(10)))
    meta = {"a": {"root": "imgs", "annotation": "a.jsonl", "repeat_time": 0.35,
                  "max_dynamic_patch": 4, "data_augment": False},
            "b": {"root": str(tmp_path), "annotation": str(tmp_path / "a.jsonl"),
                  "repeat_time": 2}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    specs, is_meta = read_inputs(tmp_path / "meta.json")
    assert is_meta and [s.name for s in specs] == ["a", "b"]
    assert specs[0].image_root == tmp_path / "imgs" and specs[0].max_tiles == 4
    assert [r.line for r in read_records(specs[0])] == [1, 2, 3]  # int(10 * 0.35)
    assert len(read_records(specs[1])) == 10  # whole repeats are applied to the lengths
    for bad, message in [
        ({"x": {"root": "r"}}, "needs 'root' and 'annotation'"),
        ({"x": {"root": "r", "annotation": "nope.jsonl"}}, "annotation .* not found"),
        ({"x": {"root": "s3://bucket/", "annotation": "a.jsonl"}}, "remote root"),
        ({"x": {"root": "r", "annotation": "a.jsonl", "repeat_time": 1.5}}, "repeat_time"),
        ({"x": {"root": "r", "annotation": "a.jsonl", "max_dynamic_patch": 0}},
         "max_dynamic_patch"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            read_inputs(tmp_path / "bad.json")
