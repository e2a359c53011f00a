"""`omnibal stats` on videos: InternVL meta + JSONL mixing text, image and video lines, ShareGPT
`videos` lists, clips, WebM/MKV without a stored frame count; checked against a hand count and
against the text transformers' InternVL processor writes for the same frames, tokenized in one
piece by transformers. Also: each epoch's lengths from the video table, and bad videos."""

import json
import random
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_omnibal.cli import main as cli_main
from megatron_omnibal.data.formats.generate import (
    TEMPLATE_SPECIALS,
    image_array,
    save_image,
    train_tokenizer,
)
from megatron_omnibal.data.frames import FrameSettings, frame_counts
from megatron_omnibal.data.lengths import load_lengths, load_videos
from megatron_omnibal.data.sample.config import StatsConfig
from megatron_omnibal.data.stats.compute import StatsError, compute_stats, write_outputs
from megatron_omnibal.data.text.conversations import INTERNVL_SYSTEM
from megatron_omnibal.data.video.reader import decode_frames
from megatron_omnibal.data.video_lengths import EpochLengths, load_video_plan
from tests.helpers.video_files import add_audio, frame_of, write_video

WORDS = ["the", "video", "shows", "a", "cat", "dog", "what", "is", "in", "frame", "red", "1",
         "2", "?", "."]
SPECIALS = ["<img>", "</img>", "<IMG_CONTEXT>"]
TPT = 256  # tokens per tile of the default InternVL tiling


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


def _conv(q, a="it is a cat"):
    return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("vstats")
    rng = random.Random(0)
    tok = train_tokenizer([" ".join(rng.choice(WORDS) for _ in range(20)) + " Frame12: x"
                           for _ in range(300)], vocab_size=300,
                          special_tokens=TEMPLATE_SPECIALS[1:], byte_level=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
                            ).save_pretrained(str(root / "tok"))
    (root / "media").mkdir()
    write_video(root / "media/a.mp4", 40, fps=10)
    write_video(root / "media/b.webm", 25, fps=5)
    write_video(root / "media/c.mkv", 12, fps=4)
    save_image(root / "media/p.png", image_array(300, 200, (10, 90, 200)))
    internvl = [
        {"id": "t", "conversations": _conv("what is in it?")},
        {"id": "v1", "video": "a.mp4", "conversations": _conv("<video>\nwhat is in the video?")},
        {"id": "i", "image": "p.png", "conversations": _conv("<image>\nwhat is it?")},
        {"id": "v2", "video": "b.webm", "conversations": _conv("the dog ?")},  # no placeholder
        {"id": "v3", "video": "a.mp4", "clip": [1.0, 2.5], "conversations": _conv("<video>\n1")},
    ]
    (root / "internvl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in internvl))
    sharegpt = [
        {"messages": [{"role": "user", "content": "<video>a<video>b"},
                      {"role": "assistant", "content": "two"}], "videos": ["c.mkv", "b.webm"]},
        {"messages": [{"role": "user", "content": "<image><image>both"},
                      {"role": "assistant", "content": "ok"}], "images": ["p.png", "p.png"]},
        {"messages": [{"role": "user", "content": [{"type": "video"}, {"type": "text",
                                                                        "text": "what?"}]},
                      {"role": "assistant", "content": "a cat"}], "videos": ["a.mp4"]},
    ]
    (root / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sharegpt))
    meta = {"internvl": {"root": "media", "annotation": "internvl.jsonl", "repeat_time": 2},
            "sharegpt": {"root": "media", "annotation": "sharegpt.jsonl"}}
    (root / "meta.json").write_text(json.dumps(meta))
    oracle = AutoTokenizer.from_pretrained(str(root / "tok"))
    oracle.add_tokens(SPECIALS, special_tokens=True)
    # (frames available, fps) per video of each record in length-file order (repeat 2 first)
    videos = [[], [(40, 10.0)], [], [(25, 5.0)], [(15, 10.0)]] * 2 + \
        [[(12, 4.0), (25, 5.0)], [], [(40, 10.0)]]
    return SimpleNamespace(root=root, tok=str(root / "tok"), oracle=oracle, videos=videos,
                           records=internvl * 2 + sharegpt)


def _processor_text(frames: int) -> str:
    """transformers' InternVLProcessor expansion of one <video> (its own method)."""
    from transformers import InternVLProcessor

    me = SimpleNamespace(start_image_token="<img>", end_image_token="</img>",
                         image_token="<IMG_CONTEXT>", image_seq_length=TPT)
    return InternVLProcessor.replace_video_token(
        me, {"pixel_values_videos": [torch.zeros(frames, 3, 1, 1)]}, 0)


def _oracle_tokens(record, counts, oracle) -> int:
    """Tokens of the record rendered with the internvl2_5 template, each <video> expanded as
    the processor does, `<video>\\n` added where InternVL adds it, in one piece."""
    if "messages" in record:
        turns = []
        for m in record["messages"]:
            c = m["content"]
            if isinstance(c, list):
                c = "".join("<video>" if p["type"] == "video" else p["text"] for p in c)
            turns.append(("user" if m["role"] == "user" else "assistant", c))
    else:
        turns = [("user" if t["from"] == "human" else "assistant", t["value"])
                 for t in record["conversations"]]
    n_media = len(record.get("videos", [])) + (1 if "video" in record else 0)
    if n_media and "<video>" not in turns[0][1]:
        turns[0] = (turns[0][0], "<video>\n" * n_media + turns[0][1])
    if "image" in record or "images" in record:
        n = len(record.get("images", [])) or 1
        if "<image>" not in turns[0][1]:
            turns[0] = (turns[0][0], "<image>\n" + turns[0][1])
        image = "<img>" + "<IMG_CONTEXT>" * TPT * 7 + "</img>"  # 7 tiles (_image_tiles)
        turns = [(r, t.replace("<image>", image)) for r, t in turns]
        assert n == sum(t.count("<img>") for _, t in turns)
    for count in counts:
        turns[0] = (turns[0][0], turns[0][1].replace("<video>", _processor_text(count), 1))
    text = f"<|im_start|>system\n{INTERNVL_SYSTEM}<|im_end|>\n" + "".join(
        f"<|im_start|>{r}\n{t}<|im_end|>\n" for r, t in turns)
    return len(oracle(text, add_special_tokens=False)["input_ids"])


def _image_tiles(record):
    """Tiles of the records' images: 300x200 (aspect 1.5) -> a 3x2 grid + thumbnail, alone
    (up to 12 tiles) or as one of two images (up to 6 each)."""
    if "image" in record:
        return 7
    return 14 if "images" in record else 0


def test_stats_count_frames_tiles_and_tokens_by_hand(data, tmp_path):
    config = StatsConfig(tokenizer=data.tok, frames=FrameSettings(min_frames=4, max_frames=4))
    result = compute_stats(data.root / "meta.json", config, workers=2, chunk_size=2,
                           progress=False)
    stats = result.stats
    assert len(stats) == 13 and not result.skipped
    for i, (record, found) in enumerate(zip(data.records, data.videos, strict=True)):
        tiles = 4 * len(found) + _image_tiles(record)
        assert stats.image_flags[i] == tiles, i
        assert stats.vit[i] == max(tiles, 1), i  # text-only: one dummy tile
        want = _oracle_tokens(record, [4] * len(found), data.oracle)
        assert stats.tokens[i] == want, (i, record)
    written = write_outputs(result, tmp_path / "lengths.npz")
    table = load_videos(written[0])
    assert table.sample.tolist() == [i for i, f in enumerate(data.videos) for _ in f]
    assert table.frames.tolist() == [n for f in data.videos for n, _ in f]  # header only
    assert table.fps.tolist() == [r for f in data.videos for _, r in f]
    assert table.tiles.tolist() == [4] * len(table)
    # the meta JSON form (one JSON list per dataset) holds the same table
    written = write_outputs(result, tmp_path / "meta_out.json")
    again = load_videos(written[0])
    assert np.array_equal(again.sample, table.sample) and np.array_equal(again.fps, table.fps)
    assert np.array_equal(load_lengths(written[0]).tokens, stats.tokens)


def test_drawn_counts_and_every_epoch_match_the_processor_text(data, tmp_path):
    config = StatsConfig(tokenizer=data.tok, frame_seed=7)  # 8..32 frames, 'rand'
    result = compute_stats(data.root / "meta.json", config, progress=False)
    path = write_outputs(result, tmp_path / "lengths.npz")[0]
    lengths = load_lengths(path)
    table, plan = load_video_plan(path)
    assert plan.frames == FrameSettings() and plan.seed == 7
    assert np.array_equal(table.tiles, frame_counts(FrameSettings(), table.frames, table.fps,
                                                    7, 0))
    assert table.tiles.min() >= 8 and table.tiles.max() <= 32 and len(set(table.tiles)) > 3
    by_epoch = EpochLengths(lengths, table, plan, seed=7)
    assert np.array_equal(by_epoch(0).tokens, lengths.tokens)  # epoch 0 of the frame seed
    for epoch in (0, 3):
        counts = by_epoch.frame_counts(epoch)
        got = by_epoch(epoch)
        for i, record in enumerate(data.records):
            mine = counts[table.of_sample(i)].tolist()
            assert got.tokens[i] == _oracle_tokens(record, mine, data.oracle), (epoch, i)
            assert got.image_flags[i] == sum(mine) + _image_tiles(record)
    assert not np.array_equal(by_epoch(3).tokens, lengths.tokens)


def test_cli_frame_flags_verify_and_bad_videos(data, tmp_path, capsys):
    root = tmp_path
    write_video(root / "ok.mp4", 30, fps=10)
    # an MP4 whose index (at the front) promises 60 frames, its data cut behind it
    cut = write_video(root / "cut.mp4", 60, fps=10, container_options={"movflags": "faststart"})
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    (root / "junk.mp4").write_bytes(b"junk" * 100)
    recs = [{"id": "ok", "video": "ok.mp4", "conversations": _conv("<video>\nq")},
            {"id": "cut", "video": "cut.mp4", "conversations": _conv("<video>\nq")},
            {"id": "junk", "video": "junk.mp4", "conversations": _conv("<video>\nq")},
            {"id": "gone", "video": "gone.mp4", "conversations": _conv("<video>\nq")},
            {"id": "clip", "video": "ok.mp4", "clip": [5, 9], "conversations": _conv("q")}]
    (root / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = root / "out.npz"
    base = ["stats", str(root / "d.jsonl"), "--model", "internvl2-8b", "--tokenizer", data.tok,
            "--out", str(out), "--workers", "1", "--no-progress", "--on-error", "skip",
            "--min-frames", "2", "--max-frames", "6", "--frame-sampling", "middle"]
    assert cli_main(base) == 0
    report = json.loads(out.with_name("out.skipped.json").read_text())
    reasons = {s["id"]: s["reason"] for s in report["datasets"]["d"]["skipped"]}
    assert set(reasons) == {"junk", "gone", "clip"}  # the cut file's header still reads
    assert "cannot open video" in reasons["junk"] and "no such file" in reasons["gone"]
    assert "clip [5.0, 9.0] holds no frame" in reasons["clip"]
    assert cli_main([*base, "--verify-images"]) == 0
    report = json.loads(out.with_name("out.skipped.json").read_text())
    reasons = {s["id"]: s["reason"] for s in report["datasets"]["d"]["skipped"]}
    assert "truncated or corrupt" in reasons["cut"] or "fails while decoding" in reasons["cut"]
    _, plan = load_video_plan(out)
    assert plan.frames == FrameSettings(min_frames=2, max_frames=6, sampling="middle")
    assert "videos: 1; frames 2-6, sampling middle" in capsys.readouterr().err
    with pytest.raises(StatsError, match="cannot open video"):
        compute_stats(root / "d.jsonl", StatsConfig(tokenizer=data.tok), progress=False)
    assert cli_main([*base[:-2], "--frame-sampling", "every2"]) == 2


def test_estimated_frame_counts_never_drop_a_good_video(data, tmp_path):
    """Matroska and WebM store no frame count. Their duration x rate is one frame too many
    when an audio track outlasts the video (50 frames at 10/s, 5.12 s) and one too few when
    the rate is 29.97/s (100 frames, 3.336 s): the frames are counted up to the last packet
    (and, with --verify-images, by decoding), so no good file is skipped, and a frame past
    the last one (a length file counted from the duration) is the last frame, as shown."""
    import av

    files = {}
    for suffix in ("mkv", "webm"):
        for frames, fps, audio in ((50, 10, 5.12), (50, 10, None),
                                   (100, Fraction(30000, 1001), None),
                                   (100, Fraction(30000, 1001), 3.0)):
            name = f"v{frames}_{audio}.{suffix}"
            path = write_video(tmp_path / name, frames, fps=fps)
            if audio:
                add_audio(path, audio)
            with av.open(str(path)) as container:  # the estimate is off by one either way
                estimate = int(container.duration / 1e6 * float(fps) + 1e-6)
            assert estimate == (51 if frames == 50 and audio else 99 if frames == 100 else 50)
            files[name] = frames
    recs = [{"id": name, "video": name, "conversations": _conv("<video>\nq")} for name in files]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "out.npz"
    base = ["stats", str(tmp_path / "d.jsonl"), "--model", "internvl2-8b", "--tokenizer",
            data.tok, "--out", str(out), "--workers", "1", "--no-progress", "--on-error",
            "skip", "--min-frames", "2", "--max-frames", "6", "--frame-sampling", "middle"]
    for verify in ([], ["--verify-images"]):
        assert cli_main([*base, *verify]) == 0
        assert len(load_lengths(out)) == len(files)
        assert load_videos(out).frames.tolist() == list(files.values())
    # what training decodes: the last frames, and one past them (taken as the last frame)
    for name, frames in files.items():
        got = decode_frames(tmp_path / name, [frames - 2, frames - 1, frames])
        assert [frame_of(p) for p in got.pixels] == [(frames - 2) % 64, (frames - 1) % 64,
                                                     (frames - 1) % 64]
