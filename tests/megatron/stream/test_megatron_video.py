"""Video samples for training, against transformers' InternVL processor text, its image
processor's pixels and frames decoded without seeking; the frame counts of each epoch on every
rank and after a resume; bad videos through the bad-sample policy; a PP=2 run on a mixed image
and video dataset.

The dataset is built here: videos written with PyAV (frame k has a known colour), noise
images, InternVL JSONL records mixing text, image and video lines, ShareGPT `videos` records,
a BPE tokenizer trained on the fly, measured by the real `omnibal stats` CLI for the tiny
model (16-pixel tiles, 4 tokens per tile).
"""

import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.balance.sampler import BalancedBatchSampler
from megatron_omnibal.data.formats.generate import image_array, save_image, write_jsonl, write_meta
from megatron_omnibal.data.frames import frame_indices
from megatron_omnibal.data.lengths import load_lengths
from megatron_omnibal.data.video_lengths import EpochLengths, load_video_plan, run_lengths
from megatron_omnibal.megatron.stream.data import BalancedDataIterator
from megatron_omnibal.megatron.stream.dataset import open_source
from megatron_omnibal.megatron.stream.iterators import filler_sample
from megatron_omnibal.megatron.stream.loader import (
    BadSamplePolicy,
    MicroBatchDataset,
    SampleLoadError,
)
from megatron_omnibal.megatron.stream.source import SourceSettings
from megatron_omnibal.models.presets import PRESETS
from tests.helpers.video_files import frame_of, write_video
from tests.megatron.stream.test_megatron_dataset import (
    _fresh_tokenizer,
    _internvl_ids,
    _oracle_sample,
    _stats,
    _tokenizer,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_local  # noqa: E402

SPEC = PRESETS["tiny"]
FLAGS = "--model tiny --max-tiles 6 --system-prompt 'you help' --min-frames 2 --max-frames 5"
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
ROOT = Path(__file__).resolve().parents[3]
WORKERS = ROOT / "tests" / "helpers" / "megatron_workers"


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


def _conv(q, a):
    return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]


def _write_dataset(root: Path, rng: random.Random) -> None:
    (root / "media").mkdir(parents=True)
    write_video(root / "media/a.mp4", 40, fps=10)
    write_video(root / "media/b.webm", 25, fps=5, size=(48, 64))
    write_video(root / "media/c.mkv", 3, fps=4)  # fewer frames than asked: repeats
    nrng = np.random.default_rng(1)
    for k, (w, h) in enumerate([(40, 20), (16, 16), (20, 70)]):
        save_image(root / f"media/{k}.png", image_array(w, h, noise=256, rng=nrng))
    words = ["the", "a", "cat", "dog", "what", "is", "in", "this", "red", "1", "2"]

    def say(lo, hi):
        return " ".join(rng.choice(words) for _ in range(rng.randrange(lo, hi)))

    lines = []
    for i in range(12):
        kind = i % 4
        rec = {"id": f"v{i}", "conversations": _conv(say(2, 8), say(1, 9))}
        if kind == 0:
            rec["video"] = rng.choice(["a.mp4", "b.webm", "c.mkv"])
            rec["conversations"][0]["value"] = "<video>\n" + rec["conversations"][0]["value"]
        elif kind == 1:  # no placeholder; a clip of a.mp4
            rec["video"], rec["clip"] = "a.mp4", [0.5, 3.0]
        elif kind == 2:
            rec["image"] = f"{i % 3}.png"
        lines.append(rec)
    write_jsonl(root / "internvl.jsonl", lines)
    write_jsonl(root / "sharegpt.jsonl", [
        {"messages": [{"role": "user", "content": "<video>the<video>cat"},
                      {"role": "assistant", "content": say(1, 6)}],
         "videos": ["c.mkv", "a.mp4"]},
        {"conversations": _conv("what <image>", say(1, 6)), "image": ["0.png"]}])
    write_meta(root / "meta.json", {
        "internvl": {"root": str(root / "media"), "annotation": "internvl.jsonl"},
        "sharegpt": {"root": str(root / "media"), "annotation": "sharegpt.jsonl",
                     "repeat_time": 2}})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    _write_dataset(root, random.Random(2))
    _tokenizer(random.Random(0), bos=False).save(str(root / "tok.json"))
    lengths_path = _stats(root / "meta.json", root / "tok.json", FLAGS, root / "lengths.npz")
    records = [json.loads(x) for x in (root / "internvl.jsonl").read_text().splitlines()]
    records += [json.loads(x) for x in (root / "sharegpt.jsonl").read_text().splitlines()] * 2
    return SimpleNamespace(root=root, lengths_path=lengths_path, records=records,
                           lengths=load_lengths(lengths_path))


def _args(data):
    return SourceSettings(data=str(data.root / "meta.json"), tokenizer=None,
                          lengths_path=str(data.lengths_path), text_scale=1)


# --- the oracle ------------------------------------------------------------------------------

def _processor_text(frames: int) -> str:
    """transformers' InternVLProcessor expansion of one <video> (its own method, 4 tokens per
    frame as the tiny model)."""
    from transformers import InternVLProcessor

    me = SimpleNamespace(start_image_token="<img>", end_image_token="</img>",
                         image_token="<IMG_CONTEXT>", image_seq_length=SPEC.tokens_per_tile)
    return InternVLProcessor.replace_video_token(
        me, {"pixel_values_videos": [torch.zeros(frames, 3, 1, 1)]}, 0)


def _processor_pixels(frames: np.ndarray) -> np.ndarray:
    """transformers' InternVL image processor (GotOcr2, no cropping) on each frame, at the
    model's tile size and ImageNet mean/std, as the converted checkpoints configure it."""
    from transformers import GotOcr2ImageProcessorPil

    proc = GotOcr2ImageProcessorPil(crop_to_patches=False, size={"height": 16, "width": 16},
                                 image_mean=IMAGENET[0], image_std=IMAGENET[1])
    return proc(images=list(frames), return_tensors="np")["pixel_values"]


def _all_frames(path: Path) -> list[np.ndarray]:
    """Every frame, decoded from the start without seeking."""
    import av

    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


def _video_oracle(rec, root, tok, counts, picked):
    """(ids, labels, pixels) of a video record: each <video> expanded as the processor does,
    turns tokenized one by one (InternVL's loader), every image token spelled out."""
    if "messages" in rec:
        turns = [("human" if m["role"] == "user" else "gpt", m["content"])
                 for m in rec["messages"]]
        paths = rec["videos"]
    else:
        turns = [(m["from"], m["value"]) for m in rec["conversations"]]
        paths = [rec["video"]]
    if "<video>" not in turns[0][1]:
        turns[0] = (turns[0][0], "<video>\n" + turns[0][1])
    for n in counts:
        turns[0] = (turns[0][0], turns[0][1].replace("<video>", _processor_text(int(n)), 1))
    ids, target = _internvl_ids(turns, tok)
    ids = np.array([127 if t == tok.token_to_id("<IMG_CONTEXT>") else t for t in ids])
    labels = np.full(len(ids), -100)
    labels[:-1] = np.where(np.array(target)[1:], ids[1:], -100)
    frames = [_all_frames(root / "media" / p) for p in paths]
    chosen = np.stack([frames[v][k] for v, idx in enumerate(picked) for k in idx])
    return ids, labels, _processor_pixels(chosen), chosen


def _picked(rec, table, plan, counts, seed, epoch, index):
    """The frames each video of a record trains on (clip offset added)."""
    clip = rec.get("clip")
    return [(int(clip[0] * table.fps[r]) if clip else 0) + frame_indices(
        plan.frames, int(counts[r]), int(table.frames[r]), float(table.fps[r]), seed, epoch,
        index, int(r)) for r in table.of_sample(index)]


def test_video_samples_equal_the_processor_tokens_and_pixels_every_epoch(data):
    table, plan = load_video_plan(data.lengths_path)
    by_epoch = EpochLengths(data.lengths, table, plan, seed=11)
    source = open_source(_args(data), data.lengths, SPEC, by_epoch=by_epoch)
    tok = _fresh_tokenizer(data.root / "tok.json", "internvl")
    seen_repeat = False
    for epoch in (0, 3):
        lengths, counts = by_epoch(epoch), by_epoch.frame_counts(epoch)
        for i, rec in enumerate(data.records):
            s = source(i, epoch)
            assert (len(s.images), len(s.tokens), int(s.image_flags.sum())) == (
                lengths.vit[i], lengths.tokens[i], lengths.image_flags[i]), (epoch, i)
            if "video" not in rec and "videos" not in rec:
                ids, labels, pixels, _ = _oracle_sample(rec, data.root / "media", tok,
                                                        "internvl", 6)
                ids_ok = s.tokens.tolist() == ids.tolist()
                assert ids_ok and s.labels.tolist() == labels.tolist(), (epoch, i)
                continue
            mine = counts[table.of_sample(i)]
            assert all(plan.frames.min_frames <= n <= plan.frames.max_frames for n in mine)
            picked = _picked(rec, table, plan, counts, 11, epoch, i)
            seen_repeat |= any(len(set(p.tolist())) < len(p) for p in picked)
            ids, labels, pixels, chosen = _video_oracle(rec, data.root, tok, mine, picked)
            assert s.tokens.tolist() == ids.tolist(), (epoch, i)
            assert s.labels.tolist() == labels.tolist(), (epoch, i)
            np.testing.assert_allclose(s.images.numpy(), pixels, atol=1e-5)
            # the frames are the planned ones (their colour says which frame they are)
            assert [frame_of(f) for f in chosen] == [int(k) % 64 for p in picked for k in p]
    assert seen_repeat  # c.mkv has 3 frames: the last repeats up to the count
    assert not np.array_equal(by_epoch.frame_counts(0), by_epoch.frame_counts(3))


def test_planned_frames_are_the_same_on_every_rank_and_after_a_resume(data):
    by_epoch = run_lengths(data.lengths_path, data.lengths, seed=5)
    config = BalanceConfig(dp_size=2, micro_batches=2, vit_budget=12,
                           token_budget=2 * int(by_epoch(0).tokens.max()) + 64, seed=5)
    samplers = [BalancedBatchSampler(data.lengths, config, dp_rank=r, lengths_of_epoch=by_epoch)
                for r in range(2)]
    for epoch in range(3):
        plans = [s.plan(epoch) for s in samplers]
        assert np.array_equal(plans[0].samples, plans[1].samples)
        lengths = by_epoch(epoch)
        for p in range(len(plans[0].pack_ptr) - 1):  # every budget holds for that epoch
            pack = plans[0].pack(p)
            assert lengths.vit[pack].sum() <= 12
            assert lengths.tokens[pack].sum() <= config.token_budget
        assert sorted(plans[0].samples.tolist()) == list(range(len(lengths)))
    # the real source checks every drawn sample against its epoch's length record; a resumed
    # iterator (a fresh one at a later step) reads the same micro-batches as the first
    source = open_source(_args(data), data.lengths, SPEC, pixels=False, by_epoch=by_epoch)

    def stream(start, n):
        sampler = BalancedBatchSampler(data.lengths, config, dp_rank=1,
                                       lengths_of_epoch=by_epoch)
        it = BalancedDataIterator(sampler, 2, MicroBatchDataset(source, lambda: filler_sample(
            SPEC)), start_step=start)
        return [(b.tokens.tolist(), len(b.images)) for b in (next(it) for _ in range(n))]

    steps = samplers[0].steps_per_epoch
    whole = stream(0, 2 * (2 * steps + 1))  # past the end of two epochs
    assert stream(steps + 1, 2 * steps) == whole[2 * (steps + 1):]


def test_bad_videos_are_logged_counted_and_never_replaced(data, tmp_path):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(data.root / "media", root / "media")
    cut = root / "media" / "cut.mp4"  # its index (at the front) promises 60 frames
    write_video(cut, 60, fps=10, container_options={"movflags": "faststart"})
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    recs = [{"id": "ok", "video": "a.mp4", "conversations": _conv("what", "a cat")},
            {"id": "cut", "video": "cut.mp4", "conversations": _conv("what", "a dog")},
            {"id": "gone", "video": "b.webm", "conversations": _conv("what", "red")}]
    write_jsonl(root / "d.jsonl", recs)
    write_meta(root / "meta.json", {"d": {"root": str(root / "media"), "annotation": "d.jsonl"}})
    lengths_path = _stats(root / "meta.json", data.root / "tok.json",
                          FLAGS.replace("--min-frames 2", "--min-frames 5"),
                          tmp_path / "l.npz")  # the cut file's header is intact: measured
    (root / "media" / "b.webm").unlink()  # gone after stats
    lengths = load_lengths(lengths_path)
    args = SourceSettings(data=str(root / "meta.json"), tokenizer=None,
                          lengths_path=str(lengths_path), text_scale=1)
    source = open_source(args, lengths, SPEC)
    assert source(0).images.shape == (5, 3, 16, 16)
    with pytest.raises(SampleLoadError, match=r"d.jsonl:2: sample 1 \(id cut\).*cut.mp4 (ends "
                                              "after frame .* truncated|fails while decoding)"):
        source(1)
    with pytest.raises(SampleLoadError, match=r"id gone.*cannot open video .*b.webm"):
        source(2)
    config = BalanceConfig(dp_size=1, micro_batches=1, vit_budget=20, token_budget=4000, seed=0)
    report = tmp_path / "bad.jsonl"
    policy = BadSamplePolicy(mode="skip", report=report, describe=source.describe)
    it = BalancedDataIterator(BalancedBatchSampler(lengths, config, dp_rank=0), 1,
                              MicroBatchDataset(source, lambda: filler_sample(SPEC)),
                              policy=policy)
    trained = sum(next(it).num_samples for _ in range(BalancedBatchSampler(
        lengths, config, dp_rank=0).steps_per_epoch))
    assert trained == 1 and policy.skipped == 2
    logged = {json.loads(x)["index"]: json.loads(x)["reason"]
              for x in report.read_text().splitlines()}
    assert "truncated" in logged[1] or "fails while decoding" in logged[1]
    assert "cannot open video" in logged[2]
    failing = BalancedDataIterator(BalancedBatchSampler(lengths, config, dp_rank=0), 1,
                                   MicroBatchDataset(source, lambda: filler_sample(SPEC)))
    with pytest.raises(SampleLoadError, match="video .*--omnibal-bad-sample skip"):
        for _ in range(3):
            next(failing)


@pytest.mark.megatron
def test_pretrain_vlm_pp2_trains_two_epochs_of_images_and_videos(data, tmp_path):
    """PP=2 through torchrun, 2 DataLoader workers on the first stage, two epochs: both stages
    read the same micro-batches, every sample once per epoch, and the last stage counts exactly
    the oracle's answer tokens of each micro-batch with the frames that epoch planned."""
    by_epoch = run_lengths(data.lengths_path, data.lengths, seed=5)
    most_vit = max(int(by_epoch(e).vit.max()) for e in range(2))
    most_tokens = max(int(by_epoch(e).tokens.max()) for e in range(2))
    config = BalanceConfig(dp_size=1, micro_batches=2, vit_budget=2 * most_vit,
                           token_budget=2 * most_tokens, seed=5)
    sampler = BalancedBatchSampler(data.lengths, config, dp_rank=0, lengths_of_epoch=by_epoch)
    epoch_steps = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        epoch_steps.append(sampler.steps_per_epoch)
    flags = ["--omnibal", "--omnibal-model", "tiny", "--omnibal-lengths",
             str(data.lengths_path), "--omnibal-data", str(data.root / "meta.json"),
             "--omnibal-vit-budget", str(config.vit_budget),
             "--omnibal-token-budget", str(config.token_budget),
             "--pipeline-model-parallel-size", "2", "--omnibal-vit-pp-layers", "4,0",
             "--omnibal-llm-pp-layers", "1,3", "--micro-batch-size", "1",
             "--global-batch-size", "2", "--train-iters", str(sum(epoch_steps)), "--lr", "1e-3",
             "--transformer-impl", "local", "--seed", "5", "--log-interval", "1",
             "--num-workers", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = run_local(2, [WORKERS / "train_record.py", tmp_path / "run", *flags], 300, env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = {}
    for p in (tmp_path / "run").glob("rank*.json"):
        doc = json.loads(p.read_text())
        ranks[doc["pp_rank"]] = doc["micro"]
    first, second = ranks[0], ranks[1]
    assert [m["indices"] for m in first] == [m["indices"] for m in second]
    assert len(second) == 2 * sum(epoch_steps)
    tok = _fresh_tokenizer(data.root / "tok.json", "internvl")
    table, plan = by_epoch.table, by_epoch.plan
    start = 0
    for epoch, steps in enumerate(epoch_steps):
        micro = second[start:start + 2 * steps]
        start += 2 * steps
        assert sorted(i for m in micro for i in m["indices"]) == list(range(len(data.records)))
        counts = by_epoch.frame_counts(epoch)
        for m in micro:
            expected = 0
            for i in m["indices"]:
                rec = data.records[i]
                if "video" in rec or "videos" in rec:
                    picked = _picked(rec, table, plan, counts, 5, epoch, i)
                    labels = _video_oracle(rec, data.root, tok, counts[table.of_sample(i)],
                                           picked)[1]
                else:
                    labels = _oracle_sample(rec, data.root / "media", tok, "internvl", 6)[1]
                expected += int((labels != -100).sum())
            assert m["tokens"] == expected
            assert np.isfinite(m["loss"]) and m["loss"] > 0


def test_videos_in_energon_samples_train_as_the_json_form(data, tmp_path):
    """`omnibal export-energon` of the video dataset (video members as they are, the clip
    kept): `omnibal stats` of the prepared Energon datasets equals the JSON form's (lengths and
    video table), and every training sample built from the shards (videos read from memory)
    equals the JSON form's, tokens, labels and pixels, in two epochs."""
    from megatron_omnibal.data.energon.export import export_energon
    from megatron_omnibal.data.lengths import load_videos

    done = export_energon(data.root / "meta.json", tmp_path / "energon", shard_size=5)
    lengths_path = _stats(done.path, data.root / "tok.json", FLAGS, tmp_path / "e.npz")
    lengths = load_lengths(lengths_path)
    for field in ("vit", "tokens", "image_flags"):
        assert np.array_equal(getattr(lengths, field), getattr(data.lengths, field)), field
    mine, theirs = load_videos(lengths_path), load_videos(data.lengths_path)
    for field in ("sample", "frames", "fps", "tiles"):
        assert np.array_equal(getattr(mine, field), getattr(theirs, field)), field
    plain = open_source(_args(data), data.lengths, SPEC,
                        by_epoch=run_lengths(data.lengths_path, data.lengths, seed=11))
    shards = open_source(SourceSettings(data=str(done.path), tokenizer=None,
                                        lengths_path=str(lengths_path), text_scale=1),
                         lengths, SPEC, by_epoch=run_lengths(lengths_path, lengths, seed=11))
    for epoch in (0, 3):
        for i in range(len(lengths)):
            a, b = plain(i, epoch), shards(i, epoch)
            assert a.tokens.tolist() == b.tokens.tolist() and a.labels.equal(b.labels)
            assert a.images.equal(b.images), (epoch, i)


def test_a_bad_video_member_of_an_energon_sample_is_a_bad_sample(data, tmp_path):
    """A video whose index promises 40 frames and whose data is zeros half-way, exported into
    an Energon shard: `omnibal stats` measures it from its header; training names its member
    (shard, key) and, under the skip policy, leaves it out of the epoch and reports it."""
    from megatron_omnibal.data.energon.export import export_energon

    media = tmp_path / "media"
    media.mkdir()
    write_video(media / "ok.mp4", 30, fps=10)
    bad = write_video(media / "bad.mp4", 40, fps=10, container_options={"movflags": "faststart"})
    raw = bytearray(bad.read_bytes())
    raw[len(raw) // 2:] = bytes(len(raw) - len(raw) // 2)
    bad.write_bytes(bytes(raw))
    write_jsonl(tmp_path / "d.jsonl", [
        {"id": "ok", "video": "ok.mp4", "conversations": _conv("<video>\nwhat", "a cat")},
        {"id": "bad", "video": "bad.mp4", "conversations": _conv("<video>\nwhat", "a dog")},
        {"id": "text", "conversations": _conv("what", "red")}])
    write_meta(tmp_path / "meta.json", {"d": {"root": str(media), "annotation": "d.jsonl"}})
    done = export_energon(tmp_path / "meta.json", tmp_path / "energon")
    lengths_path = _stats(done.path, data.root / "tok.json",
                          FLAGS.replace("--min-frames 2", "--min-frames 5"), tmp_path / "l.npz")
    lengths = load_lengths(lengths_path)
    assert len(lengths) == 3  # the header is intact: measured
    source = open_source(SourceSettings(data=str(done.path), tokenizer=None,
                                        lengths_path=str(lengths_path), text_scale=1),
                         lengths, SPEC, by_epoch=run_lengths(lengths_path, lengths, seed=0))
    assert source(0).images.shape == (5, 3, 16, 16)
    with pytest.raises(SampleLoadError, match=r"shard-000000.tar/s000000001.v0.mp4 fails while "
                                              "decoding"):
        source(1)
    config = BalanceConfig(dp_size=1, micro_batches=1, vit_budget=20, token_budget=4000, seed=0)
    report = tmp_path / "bad.jsonl"
    policy = BadSamplePolicy(mode="skip", report=report, describe=source.describe)
    sampler = BalancedBatchSampler(lengths, config, dp_rank=0)
    it = BalancedDataIterator(sampler, 1, MicroBatchDataset(source, lambda: filler_sample(SPEC)),
                              policy=policy)
    for _ in range(sampler.steps_per_epoch):
        next(it)
    assert policy.skipped == 1
    [logged] = [json.loads(x) for x in report.read_text().splitlines()]
    assert logged["index"] == 1 and "s000000001.v0.mp4 fails while decoding" in logged["reason"]
