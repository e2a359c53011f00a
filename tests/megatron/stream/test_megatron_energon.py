"""Training on a Megatron-Energon dataset (`--omnibal-data ENERGON_DIR`) against the same samples
in the JSON form: WebDataset shards of real images written in the test and prepared by Energon's
own `energon prepare`, measured by the real `omnibal stats`, trained PP=2 through torchrun.

Every training sample built from the shards equals the one built from the JSON form (tokens,
labels, pixels), a PP=2 run's losses equal the JSON run's, a resume continues exactly, a
corrupted shard member is skipped or stops the run, and a dataset changed since its length file
was made is refused naming the change."""

import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_omnibal.data.formats.generate import train_tokenizer
from megatron_omnibal.data.lengths import load_identities, load_lengths
from megatron_omnibal.megatron.stream.dataset import DatasetError, open_source
from megatron_omnibal.megatron.stream.source import SourceSettings
from megatron_omnibal.models.presets import PRESETS
from tests.helpers.energon_data import prepare_vqa, write_vqa_dataset
from tests.megatron.stream.test_megatron_dataset import _entry_flags, _stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_local  # noqa: E402
from run_records import records as _records  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "megatron_workers" / "train_record.py"
SPEC = PRESETS["tiny"]  # 16-pixel tiles, 4 tokens per tile
WORDS = ["the", "a", "cat", "dog", "chart", "shows", "value", "of", "red", "blue", "what", "is",
         "in", "this", "picture", "1", "2", "3", ",", ".", "?"]
SIZES = [(16, 16), (40, 20), (20, 70), (100, 30), (33, 33), (8, 5), (64, 48), (17, 90),
         (50, 50), (30, 12), (70, 40), (24, 24)]
FLAGS = "--model tiny --max-tiles 6 --system-prompt 'you help'"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("energon_train")
    rng = random.Random(5)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    train_tokenizer(corpus, vocab_size=90).save(str(root / "tok.json"))
    texts = [(" ".join(rng.choices(WORDS, k=rng.randrange(2, 12))),
              " ".join(rng.choices(WORDS, k=rng.randrange(1, 15)))) for _ in SIZES]
    folder, annotation = write_vqa_dataset(root, "vqa", SIZES, texts)
    prepare_vqa(folder)
    return SimpleNamespace(root=root, tok=root / "tok.json", folder=folder,
                           annotation=annotation,
                           energon=_stats(folder, root / "tok.json", FLAGS, root / "energon.npz"),
                           plain=_stats(annotation, root / "tok.json", FLAGS, root / "plain.npz"))


def _args(data_path, lengths):
    return SourceSettings(data=str(data_path), lengths_path=str(lengths))


def test_energon_samples_equal_the_json_form(data):
    lengths = load_lengths(data.energon)
    plain = load_lengths(data.plain)
    assert lengths.tokens.tolist() == plain.tokens.tolist()
    assert lengths.vit.tolist() == plain.vit.tolist() and lengths.vit.max() > 1
    energon = open_source(_args(data.folder, data.energon), lengths, SPEC)
    json_source = open_source(_args(data.annotation, data.plain), plain, SPEC)
    assert len(energon) == len(json_source) == len(SIZES)
    for i in range(len(SIZES)):
        a, b = energon(i), json_source(i)
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.labels.tolist() == b.labels.tolist()
        assert np.array_equal(a.images.numpy(), b.images.numpy())
        assert energon.describe(i).endswith(f"vqa_{i:05d} (sample {i} of 'vqa'), length "
                                            f"record {i}")


def test_a_dataset_changed_since_its_length_file_is_refused(data, tmp_path):
    import shutil
    import tarfile

    lengths = load_lengths(data.energon)
    changed = tmp_path / "vqa"
    shutil.copytree(data.folder, changed)
    with tarfile.open(changed / "part-0002.tar", "a") as tf:
        tf.add(changed / "part-0001.tar", arcname="extra_00000.bin")
    prepare_vqa(changed)
    with pytest.raises(DatasetError, match=r"'vqa' .* changed since the length file was made: "
                                           r"shard part-0002.tar: 4 -> 5 samples"):
        open_source(_args(changed, data.energon), lengths, SPEC)
    reordered = tmp_path / "reordered" / "vqa"
    shutil.copytree(data.folder, reordered)
    (reordered / ".nv-meta" / "split.yaml").write_text(
        "split_parts:\n  train:\n  - part-0001.tar\n  - part-0000.tar\n  - part-0002.tar\n"
        "  val: []\n  test: []\nexclude: []\n")
    with pytest.raises(DatasetError, match="length record 0 is sample part-0000.tar/vqa_00000 "
                                           "in the length file, part-0001.tar/vqa_00004"):
        open_source(_args(reordered, data.energon), lengths, SPEC)


def _flags(data_path, lengths_path, steps, *extra):
    lengths = load_lengths(lengths_path)
    return [*_entry_flags(data_path, lengths_path, lengths, steps), "--ckpt-format", "torch",
            *extra]


def _epoch_steps(lengths_path):
    from megatron_omnibal.balance.config import BalanceConfig
    from megatron_omnibal.balance.sampler import BalancedBatchSampler

    lengths = load_lengths(lengths_path)
    config = BalanceConfig(dp_size=1, micro_batches=2, vit_budget=2 * int(lengths.vit.max()),
                           token_budget=2 * int(lengths.tokens.max()), seed=5)
    return BalancedBatchSampler(lengths, config, dp_rank=0).steps_per_epoch


def _torchrun(out, flags, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    return run_local(2, [WORKER, out, *flags], timeout, env)


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.megatron
def test_pp2_training_equals_the_json_form_and_resumes_exactly(data, tmp_path):
    """One epoch and two steps of PP=2 training on the shards, checkpointed two steps into the
    second epoch: the same samples and per-micro-batch losses as the JSON form's run, every
    sample once in the first epoch, and a resume from the checkpoint continues with the same
    samples and losses."""
    epoch = _epoch_steps(data.energon)
    assert epoch == _epoch_steps(data.plain)
    total, stop = epoch + 3, epoch + 1
    ckpt = tmp_path / "ckpt"
    _ok(_torchrun(tmp_path / "energon", _flags(data.folder, data.energon, total, "--save",
                                               str(ckpt), "--save-interval", str(stop))))
    _ok(_torchrun(tmp_path / "json", _flags(data.annotation, data.plain, total)))
    _ok(_torchrun(tmp_path / "resumed", _flags(data.folder, data.energon, total, "--load",
                                               str(ckpt), "--ckpt-step", str(stop))))
    energon, plain, resumed = (_records(tmp_path / n) for n in ("energon", "json", "resumed"))
    for rank in (0, 1):
        e, p = energon[rank]["micro"], plain[rank]["micro"]
        assert [m["indices"] for m in e] == [m["indices"] for m in p]
        first = sorted(i for m in e[:2 * epoch] for i in m["indices"])
        assert first == list(range(len(SIZES)))
        r = resumed[rank]["micro"]
        assert resumed[rank]["start"] == stop and len(r) == 2 * (total - stop)
        assert [m["indices"] for m in r] == [m["indices"] for m in e[2 * stop:]]
    e, p, r = energon[1]["micro"], plain[1]["micro"], resumed[1]["micro"]
    assert sum(m["tokens"] for m in e) > 0
    assert [m["tokens"] for m in e] == [m["tokens"] for m in p]
    assert [m["loss"] for m in e] == pytest.approx([m["loss"] for m in p], rel=1e-6)
    assert [m["loss"] for m in r] == pytest.approx([m["loss"] for m in e[2 * stop:]], rel=1e-6)


@pytest.mark.megatron
def test_a_corrupted_shard_member_is_skipped_or_stops_the_run(data, tmp_path):
    """An image member overwritten in place (its shard keeps its size, its prepared media
    metadata its size): `omnibal stats` passes; under --omnibal-bad-sample skip one epoch trains
    every other sample and the report names the member's shard and key; by default the run
    stops naming it."""
    import shutil

    broken = tmp_path / "vqa"
    shutil.copytree(data.folder, broken)
    shard = broken / "part-0001.tar"
    raw = bytearray(shard.read_bytes())
    start = raw.index(b"\xff\xd8\xff")  # the shard's first image: vqa_00004
    raw[start:start + 16] = b"\x00" * 16
    shard.write_bytes(bytes(raw))
    lengths_path = _stats(broken, data.tok, FLAGS, tmp_path / "lengths.npz")
    assert [k for _, k in load_identities(lengths_path)][4] == "vqa_00004"
    epoch = _epoch_steps(lengths_path)
    flags = _flags(broken, lengths_path, epoch)
    report = tmp_path / "bad.jsonl"
    _ok(_torchrun(tmp_path / "skip", [*flags, "--omnibal-bad-sample", "skip",
                                      "--omnibal-bad-sample-report", str(report)]))
    ranks = _records(tmp_path / "skip")
    trained = sorted(i for m in ranks[0]["micro"] for i in m["indices"])
    assert trained == list(range(len(SIZES)))  # drawn once each; sample 4 left out when loaded
    skipped = [json.loads(line) for line in report.read_text().splitlines()]
    assert [e["index"] for e in skipped] == [4]
    assert "part-0001.tar/vqa_00004" in skipped[0]["sample"]
    assert "cannot decode image" in skipped[0]["reason"]
    proc = _torchrun(tmp_path / "stop", flags)
    assert proc.returncode != 0
    stops = [x for x in proc.stderr.splitlines() if x.startswith("pretrain_vlm: error:")]
    assert stops and "part-0001.tar/vqa_00004" in stops[0], proc.stderr[-3000:]
