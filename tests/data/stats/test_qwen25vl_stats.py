"""`omnibal stats` for Qwen2.5-VL: tokens per image against transformers' own image processor on
images of odd sizes, whole samples against the tokenizer's chat template with every
`<|image_pad|>` spelled out, the processor limits read from the checkpoint, bad images named or
skipped, and an exact resume of the balanced sampler over the length file (vision measured in
merge groups, 4 patches each). Videos of odd sizes and rates (one, two in a sample, a clip)
against transformers' video processor rules with the checkpoint's video_preprocessor_config.json
and the chat template with every `<|video_pad|>` spelled out; a one-frame and a corrupt video
are bad samples, named or skipped."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.balance.sampler import BalancedBatchSampler
from megatron_omnibal.cli import main as cli_main
from megatron_omnibal.data.formats.generate import image_array, save_image, train_tokenizer
from megatron_omnibal.data.images.tiling import (
    QWEN_MAX_PIXELS,
    QWEN_MIN_PIXELS,
    TilingConfig,
    TilingError,
    image_tiles,
    smart_resize,
)
from megatron_omnibal.data.lengths import (
    load_image_tiles,
    load_lengths,
    load_videos,
    read_stats_config,
)
from megatron_omnibal.data.native.video import NativeVideoSettings
from megatron_omnibal.data.video_lengths import load_video_plan
from megatron_omnibal.models.data_side import model_data_side
from megatron_omnibal.models.presets import get_preset
from tests.data.native.test_qwen25vl_video import transformers_video_rules
from tests.helpers.image_records import ASK, image_records, write_records
from tests.helpers.video_files import write_video

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>",
            "<|vision_end|>", "<|video_pad|>"]  # fmt: skip
CHATML = ("{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
          "assistant.<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}"
          "\n{{ m['content'] }}<|im_end|>\n{% endfor %}")  # fmt: skip
WORDS = ["the", "a", "cat", "chart", "shows", "value", "of", "year", "what", "is", "in", "this",
         "picture", "answer", "1", "2", "3", ",", ".", "?"]
# Odd sizes (width, height): below min_pixels, above max_pixels, halves that round to even,
# long thin ones up to the aspect-ratio limit.
SIZES = [(37, 901), (333, 517), (1999, 13), (28, 28), (14, 42), (2000, 1500), (97, 3),
         (5, 1000), (1, 150), (419, 419), (770, 406), (3000, 17)]
SMALL_MAX = 28 * 28 * 64  # 64 tokens at most: the big images are scaled down


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


def _processor_tokens(width: int, height: int, min_pixels: int, max_pixels: int) -> int:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    image = Image.fromarray(image_array(width, height, (30, 90, 200)), "RGB")
    t, h, w = proc(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    return t * h * w // proc.merge_size**2


def test_smart_resize_matches_transformers() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs

    rng = np.random.default_rng(0)
    sides = np.concatenate([rng.integers(1, 200, 3000), rng.integers(1, 9000, 3000)])
    limits = [(QWEN_MIN_PIXELS, QWEN_MAX_PIXELS), (3136, 1003520), (28 * 28 * 16, SMALL_MAX)]
    for k in range(0, len(sides) - 1, 2):
        h, w = int(sides[k]), int(sides[k + 1])
        for low, high in limits:
            if max(h, w) > 200 * min(h, w):
                with pytest.raises(ValueError):
                    theirs(h, w, 28, low, high)
                with pytest.raises(TilingError, match="aspect ratio above 200"):
                    smart_resize(h, w, 28, low, high)
            else:
                assert smart_resize(h, w, 28, low, high) == theirs(h, w, 28, low, high), (h, w)


@pytest.mark.parametrize("limits", [(QWEN_MIN_PIXELS, QWEN_MAX_PIXELS), (28 * 28 * 16, SMALL_MAX)])
def test_tokens_per_image_match_the_image_processor(limits: tuple[int, int]) -> None:
    tiling = TilingConfig(mode="native", tile=28, tokens_per_tile=1, min_pixels=limits[0],
                          max_pixels=limits[1])  # fmt: skip
    for width, height in SIZES:
        expected = _processor_tokens(width, height, *limits)
        assert image_tiles(width, height, tiling, images_in_sample=3) == (expected, expected)


def test_processor_limits_come_from_the_checkpoint(tmp_path: Path) -> None:
    spec = get_preset("qwen2.5-vl-7b")
    side = model_data_side(spec)
    assert (side.tiling.mode, side.tiling.min_pixels, side.tiling.max_pixels) == (
        "native", 3136, 12845056)  # fmt: skip
    assert side.template == "qwen2_vl" and not side.dummy_tile
    assert side.image_style.compact() == "<|vision_start|><|image_pad|><|vision_end|>"
    for name, pre in (("old", {"min_pixels": 1000, "max_pixels": 9000, "patch_size": 14,
                               "merge_size": 2}),
                      ("new", {"size": {"shortest_edge": 1000, "longest_edge": 9000}}),
                      ("both", {"size": {"shortest_edge": 5, "longest_edge": 7},
                                "min_pixels": 1000, "max_pixels": 9000})):  # fmt: skip
        ckpt = _checkpoint(tmp_path / name, pre)
        side = model_data_side(spec, ckpt)
        assert (side.tiling.min_pixels, side.tiling.max_pixels) == (1000, 9000), name
        assert side.template == "hf" and side.tokenizer == str(ckpt)
    bad = _checkpoint(tmp_path / "bad", {"patch_size": 16, "merge_size": 2})
    with pytest.raises(ValueError, match="patch_size x merge_size = 32 px, the model's merge "
                                         "group is 28 px"):
        model_data_side(spec, bad)
    assert model_data_side(spec).native_video == NativeVideoSettings()  # qwen-vl-utils'
    video = _checkpoint(tmp_path / "video", {})
    (video / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PRE))
    assert model_data_side(spec, video).native_video == NativeVideoSettings(
        fps=3.0, min_frames=4, max_frames=10, min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 12,
        max_video_tokens=80)  # fmt: skip
    for edit, message in (({"temporal_patch_size": 1}, "temporal_patch_size 1, the model's"),
                          ({"min_frames": 0}, "1 <= min_frames <= max_frames"),
                          ({"image_mean": [1, 2]}, "image_mean \\[1, 2\\] is not three")):
        (video / "video_preprocessor_config.json").write_text(json.dumps({**VIDEO_PRE, **edit}))
        with pytest.raises(ValueError, match=f"video_preprocessor_config.json: .*{message}"):
            model_data_side(spec, video)


def _checkpoint(path: Path, preprocessor: dict) -> Path:
    """A Qwen2.5-VL directory: hub-style flat config.json, processor settings, tokenizer with
    a ChatML chat template."""
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True)
    vision = {"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4,
              "out_hidden_size": 64, "fullatt_block_indexes": [1, 3], "window_size": 112}
    config = {"model_type": "qwen2_5_vl", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 152064, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
              "vision_config": vision}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(corpus, 300, SPECIALS, byte_level=True))
    tok.chat_template = CHATML
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen")
    names, recs = image_records(root, SIZES, lambda k: "png" if k % 2 else "jpg")
    recs.append({"id": "sys", "image": names[5], "conversations": [
        {"from": "system", "value": "answer"}, *ASK]})  # fmt: skip
    write_records(root / "data.json", recs)
    ckpt = _checkpoint(root / "ckpt", {"min_pixels": QWEN_MIN_PIXELS, "max_pixels": SMALL_MAX,
                                       "patch_size": 14, "merge_size": 2})
    return SimpleNamespace(root=root, recs=recs, ckpt=ckpt)


def _oracle(rec: dict, root: Path, tok, max_pixels: int) -> tuple[int, int, list[int]]:
    """(vit_num, token_num, tokens of each image): the image processor's grids, every pad
    spelled out, the conversation through the tokenizer's chat template."""
    images = rec.get("image") or []
    images = [images] if isinstance(images, str) else images
    per_image = []
    for name in images:
        with Image.open(root / name) as img:
            per_image.append(_processor_tokens(*img.size, QWEN_MIN_PIXELS, max_pixels))
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    messages, k = [], 0
    for turn in rec["conversations"]:
        text = turn["value"]
        while "<image>" in text:
            pads = "<|image_pad|>" * per_image[k]
            text = text.replace("<image>", f"<|vision_start|>{pads}<|vision_end|>", 1)
            k += 1
        messages.append({"role": role[turn["from"]], "content": text})
    ids = tok.apply_chat_template(messages, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return sum(per_image), len(ids), per_image


def test_stats_of_a_checkpoint_match_processor_and_chat_template(data, tmp_path) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "lengths.npz"
    assert cli_main(["stats", str(data.root / "data.json"), "--model", str(data.ckpt), "--out",
                     str(out), "--workers", "2", "--chunk-size", "4", "--no-progress"]) == 0
    tok = AutoTokenizer.from_pretrained(str(data.ckpt))
    expected = [_oracle(r, data.root, tok, SMALL_MAX) for r in data.recs]
    stats = load_lengths(out)
    assert stats.vit.tolist() == [e[0] for e in expected]  # text-only: 0, no blank tile
    assert stats.image_flags.tolist() == [e[0] for e in expected]
    assert stats.tokens.tolist() == [e[1] for e in expected]
    two = [i for i, r in enumerate(data.recs) if r["id"] == "two"]
    assert load_image_tiles(out) == {two[0]: tuple(expected[two[0]][2])}
    stored = read_stats_config(out)
    assert stored["tiling"]["mode"] == "native" and stored["tiling"]["max_pixels"] == SMALL_MAX
    assert stored["template"] == "hf" and not stored["dummy_tile"]
    # The preset with the built-in ChatML template and the same limits counts the same.
    preset = tmp_path / "preset.npz"
    assert cli_main(["stats", str(data.root / "data.json"), "--model", "qwen2.5-vl-7b",
                     "--tokenizer", str(data.ckpt), "--max-pixels", str(SMALL_MAX), "--out",
                     str(preset), "--workers", "1", "--no-progress"]) == 0
    again = load_lengths(preset)
    assert again.tokens.tolist() == stats.tokens.tolist()
    assert read_stats_config(preset)["template"] == "qwen2_vl"


def test_wrong_tiling_flags_are_refused(data, tmp_path, capsys) -> None:
    base = ["stats", str(data.root / "data.json"), "--out", str(tmp_path / "o.npz"),
            "--no-progress"]  # fmt: skip
    assert cli_main([*base, "--model", str(data.ckpt), "--tiling", "dynamic"]) == 2
    assert "takes native-resolution images (--tiling native)" in capsys.readouterr().err
    assert cli_main([*base, "--model", "internvl2-8b", "--tiling", "native"]) == 2
    assert "takes tiles, not native resolution" in capsys.readouterr().err
    assert cli_main([*base, "--model", "internvl2-8b", "--max-pixels", "5000"]) == 2
    assert "--min-pixels / --max-pixels" in capsys.readouterr().err
    assert cli_main([*base, "--model", "internvl2-8b", "--video-fps", "1"]) == 2
    assert "takes videos as frames of tiles" in capsys.readouterr().err
    assert cli_main([*base, "--model", str(data.ckpt), "--video-min-frames", "9",
                     "--video-max-frames", "5"]) == 2
    assert "1 <= min_frames <= max_frames" in capsys.readouterr().err
    assert cli_main([*base, "--model", str(data.ckpt), "--min-pixels", "9000",
                     "--max-pixels", "5000"]) == 2
    assert "0 < min_pixels <= max_pixels" in capsys.readouterr().err


def test_bad_images_and_videos_are_named_or_skipped(data, tmp_path) -> None:
    save_image(tmp_path / "thin.png", image_array(1005, 5, (1, 2, 3)))  # aspect ratio 201
    (tmp_path / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00")
    conv = [{"from": "human", "value": "<image> what ?"}, {"from": "gpt", "value": "1"}]
    video = [{"from": "human", "value": "<video> what ?"}, {"from": "gpt", "value": "1"}]
    good = data.recs[:3]
    recs = [good[0], {"id": "thin", "image": str(tmp_path / "thin.png"), "conversations": conv},
            good[1], {"id": "bad", "image": str(tmp_path / "corrupt.jpg"), "conversations": conv},
            {"id": "vid", "video": "clip.mp4", "conversations": video}, good[2]]  # fmt: skip
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(recs))
    base = ["stats", str(path), "--model", str(data.ckpt), "--image-root", str(data.root),
            "--no-progress", "--workers", "1"]  # fmt: skip
    out = tmp_path / "mixed.npz"
    assert cli_main([*base, "--out", str(out)]) == 1
    assert not out.exists()
    assert cli_main([*base, "--out", str(out), "--on-error", "skip"]) == 0
    report = json.loads((tmp_path / "mixed.skipped.json").read_text())["datasets"]["mixed"]
    reasons = {s["id"]: s["reason"] for s in report["skipped"]}
    assert "thin.png: 1005x5 pixels: aspect ratio above 200" in reasons["thin"]
    assert "corrupt image" in reasons["bad"]
    assert "cannot open video" in reasons["vid"] and "clip.mp4: no such file" in reasons["vid"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(data.ckpt))
    assert load_lengths(out).tokens.tolist() == [
        _oracle(r, data.root, tok, SMALL_MAX)[1] for r in good]


def test_balanced_sampler_resumes_exactly_on_merge_groups(data, tmp_path) -> None:
    out = tmp_path / "lengths.npz"
    recs = data.recs * 20
    (tmp_path / "many.json").write_text(json.dumps(recs))
    assert cli_main(["stats", str(tmp_path / "many.json"), "--model", str(data.ckpt),
                     "--image-root", str(data.root), "--out", str(out), "--workers", "1",
                     "--no-progress"]) == 0  # fmt: skip
    lengths = load_lengths(out)
    budget = int(lengths.vit.max()) * 2  # merge groups per micro-batch
    config = BalanceConfig(dp_size=2, micro_batches=2, vit_budget=budget,
                           token_budget=int(lengths.tokens.max()) * 3, seed=3)
    first = BalancedBatchSampler(lengths, config, dp_rank=1)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))
    expected = [next(it) for _ in range(first.steps_per_epoch * 2 + 2)]
    resumed = BalancedBatchSampler(lengths, config, dp_rank=1)
    resumed.load_state_dict(state)
    it2 = iter(resumed)
    assert [next(it2) for _ in range(len(expected))] == expected
    both = [BalancedBatchSampler(lengths, config, dp_rank=r) for r in range(2)]
    seen = [i for s in both for _, batch in zip(range(s.steps_per_epoch * 2), iter(s),
                                                strict=False) for i in batch]  # fmt: skip
    assert sorted(seen) == list(range(len(lengths)))
    for s in both:
        for _, batch in zip(range(s.steps_per_epoch * 2), iter(s), strict=False):
            assert lengths.vit[batch].sum() <= budget


VIDEO_PRE = {"fps": 3.0, "min_frames": 4, "max_frames": 10, "max_video_tokens": 80,
             "size": {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 12},
             "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}  # fmt: skip


def _video_units(path: Path, clip: list[float] | None, rules) -> int:
    """Merge groups of a video by transformers' rules, its frames counted by decoding them."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate)
        width, height = stream.codec_context.width, stream.codec_context.height
        frames = sum(1 for _ in container.decode(video=0))
    if clip:
        first = int(clip[0] * fps)
        frames = min(int((clip[1] - clip[0]) * fps), frames - first)
    count = len(rules.sample_frames(SimpleNamespace(total_num_frames=frames, fps=fps)))
    count -= count % 2  # see tests/data/native/test_qwen25vl_video.py
    h, w = rules.resize(torch.zeros(()).expand(1, count, 3, height, width), rules.size, None,
                        28, 2, True)  # fmt: skip
    return count // 2 * (h // 28) * (w // 28)


def test_video_stats_of_a_checkpoint_match_transformers_and_chat_template(tmp_path) -> None:
    from transformers import AutoTokenizer

    ckpt = _checkpoint(tmp_path / "ckpt", {"min_pixels": QWEN_MIN_PIXELS,
                                           "max_pixels": SMALL_MAX})  # fmt: skip
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PRE))
    media = tmp_path / "media"
    media.mkdir()
    write_video(media / "a.mp4", 23, fps=10, size=(70, 46), gop=5)
    write_video(media / "b.webm", 9, fps=4, size=(36, 100))
    write_video(media / "c.mkv", 40, fps=25, size=(200, 30))
    write_video(media / "one.mp4", 1, fps=10)
    (media / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\x00" * 64)
    ask = [{"from": "human", "value": "<video>\nwhat is in this picture ?"},
           {"from": "gpt", "value": "a cat , 3 ."}]
    recs = [{"id": "a", "video": "media/a.mp4", "conversations": ask},
            {"id": "clip", "video": "media/a.mp4", "clip": [0.5, 1.9], "conversations": ask},
            {"id": "one", "video": "media/one.mp4", "conversations": ask},
            {"id": "two", "videos": ["media/b.webm", "media/c.mkv"], "conversations": [
                {"from": "human", "value": "<video> and <video> : the value ?"},
                {"from": "gpt", "value": "2"}]},
            {"id": "bad", "video": "media/bad.mp4", "conversations": ask},
            {"id": "text", "conversations": [{"from": "human", "value": "what year ?"},
                                             {"from": "gpt", "value": "1 2 3"}]}]  # fmt: skip
    (tmp_path / "v.json").write_text(json.dumps(recs))
    out = tmp_path / "v.npz"
    assert cli_main(["stats", str(tmp_path / "v.json"), "--model", str(ckpt), "--image-root",
                     str(tmp_path), "--out", str(out), "--on-error", "skip", "--verify-images",
                     "--workers", "1", "--no-progress"]) == 0  # fmt: skip
    reasons = {s["id"]: s["reason"] for s in json.loads(
        (tmp_path / "v.skipped.json").read_text())["datasets"]["v"]["skipped"]}  # fmt: skip
    assert set(reasons) == {"one", "bad"}
    assert "one.mp4: 1 frame(s); Qwen2.5-VL takes at least 2" in reasons["one"]
    assert "bad.mp4" in reasons["bad"]
    settings = NativeVideoSettings(fps=3.0, min_frames=4, max_frames=10, max_video_tokens=80,
                                   min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 12)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    kept = [r for r in recs if r["id"] not in reasons]
    want_units, want_tokens = _video_oracle(kept, tmp_path, settings, tok)
    stats = load_lengths(out)
    assert stats.vit.tolist() == stats.image_flags.tolist() == want_units
    assert stats.tokens.tolist() == want_tokens
    assert read_stats_config(out)["native_video"]["fps"] == 3.0
    table, plan = load_video_plan(out)
    assert plan is None  # the same frames every epoch
    assert table.sample.tolist() == [0, 1, 2, 2] and table.tiles.sum() == sum(want_units)
    assert table.frames.tolist()[:2] == [23, 14] and load_videos(out).fps.tolist()[2] == 4.0
    # Flags override the checkpoint's settings (as ms-swift's FPS_MAX_FRAMES etc.).
    again = tmp_path / "flags.npz"
    assert cli_main(["stats", str(tmp_path / "v.json"), "--model", str(ckpt), "--image-root",
                     str(tmp_path), "--out", str(again), "--on-error", "skip", "--video-fps",
                     "1.5", "--video-max-frames", "6", "--video-max-pixels", str(28 * 28 * 4),
                     "--workers", "1", "--no-progress"]) == 0  # fmt: skip
    flagged = replace(settings, fps=1.5, max_frames=6, max_pixels=28 * 28 * 4)
    fewer = _video_oracle(kept, tmp_path, flagged, tok)[0]
    assert load_lengths(again).vit.tolist() == fewer and fewer != want_units


def _video_oracle(recs: list[dict], root: Path, settings: NativeVideoSettings,
                  tok) -> tuple[list[int], list[int]]:
    """(merge groups, tokens) of video records: transformers' rules, the chat template with
    every `<|video_pad|>` spelled out."""
    rules = transformers_video_rules(settings)
    want_units, want_tokens = [], []
    for rec in recs:
        paths = rec.get("videos") or ([rec["video"]] if "video" in rec else [])
        units = [_video_units(root / p, rec.get("clip"), rules) for p in paths]
        messages = []
        for turn in rec["conversations"]:
            text = turn["value"]
            for n in units:
                text = text.replace("<video>", "<|vision_start|>" + "<|video_pad|>" * n
                                    + "<|vision_end|>", 1)  # fmt: skip
            messages.append({"role": {"human": "user", "gpt": "assistant"}[turn["from"]],
                             "content": text})
        ids = tok.apply_chat_template(messages, tokenize=True)
        want_units.append(sum(units))
        want_tokens.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return want_units, want_tokens
