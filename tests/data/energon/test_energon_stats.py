"""`omnibal stats` on Megatron-Energon datasets: WebDataset shards of real images, prepared by
Energon's own `energon prepare`, measured against the same samples in the JSON form (whose
counts test_stats.py checks against an independent oracle)."""

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_omnibal.cli import main as cli_main
from megatron_omnibal.data.energon.members import EnergonError
from megatron_omnibal.data.energon.source import EnergonOptions
from megatron_omnibal.data.formats.generate import TEMPLATE_SPECIALS, train_tokenizer
from megatron_omnibal.data.images.tiling import TilingConfig
from megatron_omnibal.data.lengths import load_identities, load_lengths
from megatron_omnibal.data.sample.config import StatsConfig
from megatron_omnibal.data.stats.compute import compute_stats, write_outputs
from tests.helpers.energon_data import energon_prepare, prepare_vqa, write_vqa_dataset

WORDS = ["the", "a", "cat", "dog", "chart", "shows", "what", "is", "in", "this", "red", "blue",
         "value", "year", "left", "right", "1", "2", "3", "?", "."]
SIZES = [(100, 100), (800, 600), (1920, 1080), (300, 900), (448, 448), (1000, 1000),
         (2500, 400), (37, 90), (640, 480), (1344, 896), (50, 40), (1200, 1300), (700, 300)]


def _texts(rng, n):
    return [(" ".join(rng.choices(WORDS, k=rng.randrange(2, 20))),
             " ".join(rng.choices(WORDS, k=rng.randrange(1, 30)))) for _ in range(n)]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("energon")
    rng = random.Random(0)
    tok = train_tokenizer([" ".join(rng.choices(WORDS, k=30)) for _ in range(200)],
                          vocab_size=200, special_tokens=TEMPLATE_SPECIALS[1:], byte_level=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(root / "tok"))
    first, first_json = write_vqa_dataset(root, "alpha", SIZES, _texts(rng, len(SIZES)))
    second, second_json = write_vqa_dataset(root, "beta", SIZES[:7][::-1], _texts(rng, 7),
                                            per_shard=3)
    prepare_vqa(first, media_metadata=True)
    prepare_vqa(second, media_metadata=False)  # sizes from the image headers
    return SimpleNamespace(root=root, tok=str(root / "tok"), first=first, second=second,
                           first_json=first_json, second_json=second_json)


def _same(a, b):
    assert a.vit.tolist() == b.vit.tolist()
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.image_flags.tolist() == b.image_flags.tolist()


def test_prepared_folder_equals_the_json_form(data, tmp_path):
    config = StatsConfig(tokenizer=data.tok, tiling=TilingConfig(max_tiles=6))
    for folder, annotation in ((data.first, data.first_json), (data.second, data.second_json)):
        energon = compute_stats(folder, config, workers=2, chunk_size=3, progress=False)
        plain = compute_stats(annotation, config, progress=False)
        _same(energon.stats, plain.stats)
        assert energon.stats.vit.max() > 2  # multi-tile images
        out = tmp_path / f"{folder.name}.npz"
        write_outputs(energon, out)
        _same(load_lengths(out), plain.stats)
        names = [r["id"] for r in json.loads(annotation.read_text())]
        shards = sorted({p.name for p in folder.glob("*.tar")})
        ids = load_identities(out)
        assert [key for _, key in ids] == names
        assert sorted({shard for shard, _ in ids}) == shards
        run = json.loads(str(np.load(out)["stats_config"]))
        assert run["energon"]["split"] == "train"
        assert set(run["energon"]["datasets"][0]["shards"]) == set(shards)


def test_metadataset_repetitions_equal_an_internvl_meta_file(data, tmp_path):
    mds = tmp_path / "mix.yaml"
    mds.write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n"
        f"    blend_epochized:\n      - repetitions: 2\n        path: {data.first}\n"
        f"      - repetitions: 0.5\n        path: {data.second}\n")
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({
        "alpha": {"root": str(data.root), "annotation": str(data.first_json),
                  "repeat_time": 2},
        "beta": {"root": str(data.root), "annotation": str(data.second_json),
                 "repeat_time": 0.5}}))
    config = StatsConfig(tokenizer=data.tok)
    energon = compute_stats(mds, config, progress=False)
    plain = compute_stats(meta, config, progress=False)
    _same(energon.stats, plain.stats)
    assert energon.stats.names == ("alpha", "beta") and energon.is_meta
    out = tmp_path / "mix.json"
    write_outputs(energon, out, fmt="jsonl")
    ids = load_identities(out)
    assert len(ids) == len(SIZES) * 2 + 3 and ids[:len(SIZES)] == ids[len(SIZES):2 * len(SIZES)]
    weighted = tmp_path / "weighted.yaml"
    weighted.write_text(mds.read_text().replace("blend_epochized", "blend")
                        .replace("repetitions", "weight"))
    with pytest.raises(EnergonError, match="blend_epochized"):
        compute_stats(weighted, config, progress=False)
    with pytest.raises(EnergonError, match="no split 'val'"):
        compute_stats(mds, config, progress=False, energon=EnergonOptions(split="val"))


def test_crude_samples_and_a_task_encoder(data, tmp_path, monkeypatch):
    """A CrudeWebdataset sample's json member is a project record; a user's task encoder turns
    any sample into one: both equal the JSON form."""
    import shutil

    crude = tmp_path / "crude"
    shutil.copytree(data.second, crude, ignore=shutil.ignore_patterns(".nv-meta", "*.idx"))
    energon_prepare(crude, "--sample-type", "CrudeWebdataset")
    config = StatsConfig(tokenizer=data.tok)
    plain = compute_stats(data.second_json, config, progress=False)
    _same(compute_stats(crude, config, progress=False).stats, plain.stats)
    (tmp_path / "my_encoder.py").write_text(
        "class Encoder:\n"
        "    def encode_sample(self, sample):\n"
        "        turns = [{'from': 'human', 'value': sample.context},\n"
        "                 {'from': 'gpt', 'value': sample.answers}]\n"
        "        return {'conversations': turns, 'images': [sample.image]}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    encoded = compute_stats(data.second, config, progress=False,
                            energon=EnergonOptions(task_encoder="my_encoder:Encoder"))
    _same(encoded.stats, plain.stats)


def test_cli_measures_a_folder_and_names_a_bad_member(data, tmp_path, capsys):
    import shutil

    out = tmp_path / "lengths.npz"
    rc = cli_main(["stats", str(data.first), "--model", "internvl2-8b", "--tokenizer", data.tok,
                   "--out", str(out), "--workers", "1", "--no-progress"])
    assert rc == 0
    assert f"{len(SIZES)} samples in 1 dataset(s), 0 skipped" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(data.second, broken)
    shard = broken / "part-0001.tar"
    raw = bytearray(shard.read_bytes())
    start = raw.index(b"\xff\xd8\xff")  # the first JPEG member of the shard: garbage header
    raw[start:start + 64] = b"\x00" * 64
    shard.write_bytes(bytes(raw))
    rc = cli_main(["stats", str(broken), "--model", "internvl2-8b", "--tokenizer", data.tok,
                   "--out", str(tmp_path / "b.npz"), "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "part-0001.tar/beta_00003" in err and "corrupt image" in err
    rc = cli_main(["stats", str(broken), "--model", "internvl2-8b", "--tokenizer", data.tok,
                   "--out", str(tmp_path / "b.npz"), "--workers", "1", "--no-progress",
                   "--on-error", "skip"])
    assert rc == 0
    assert [k for _, k in load_identities(tmp_path / "b.npz")] == [
        f"beta_{k:05d}" for k in range(7) if k != 3]


def test_export_round_trip_gives_the_same_stats(data, tmp_path, capsys):
    """`omnibal export-energon` of a JSON list and of an InternVL meta file with repeat_time:
    `omnibal stats` of the export equals `omnibal stats` of the source."""
    from megatron_omnibal.data.energon.export import ExportError, export_energon

    config = StatsConfig(tokenizer=data.tok)
    rc = cli_main(["export-energon", str(data.first_json), "--out", str(tmp_path / "one"),
                   "--shard-size", "5"])
    assert rc == 0 and f"{len(SIZES)} samples in 1 dataset(s)" in capsys.readouterr().err
    assert len(list((tmp_path / "one").glob("*.tar"))) == 3
    _same(compute_stats(tmp_path / "one", config, progress=False).stats,
          compute_stats(data.first_json, config, progress=False).stats)
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({
        "a/1": {"root": str(data.root), "annotation": str(data.first_json), "repeat_time": 2},
        "b": {"root": str(data.root), "annotation": str(data.second_json),
              "repeat_time": 0.5}}))
    done = export_energon(meta, tmp_path / "two", shard_size=4)
    assert done.path.name == "metadataset.yaml" and done.samples == [len(SIZES), 7]
    _same(compute_stats(done.path, config, progress=False).stats,
          compute_stats(meta, config, progress=False).stats)
    with pytest.raises(ExportError, match="not empty"):
        export_energon(meta, tmp_path / "two")
