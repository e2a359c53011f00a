"""`omnibal stats` for Qwen3-VL images: tokens per image equal transformers' image processor
with Qwen3-VL's released settings (16 px patches merged 2 x 2: a 32 px factor, the `size`
{shortest_edge, longest_edge} pixel limits) on images of odd sizes; whole samples equal the
checkpoint's chat template with every `<|image_pad|>` spelled out; without a preprocessor file
(or for the preset) the released limits and mean = std = 0.5 apply."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from PIL import Image

from megatron_omnibal.cli import main as cli_main
from megatron_omnibal.data.formats.generate import image_array, train_tokenizer
from megatron_omnibal.data.images.tiling import image_tiles
from megatron_omnibal.data.lengths import load_lengths, read_stats_config
from megatron_omnibal.models.data_side import model_data_side
from megatron_omnibal.models.presets import get_preset
from tests.data.stats.test_qwen25vl_stats import CHATML, SIZES, SPECIALS, WORDS
from tests.helpers.image_records import image_records, write_records
from tests.models.test_qwen3_vl_config import hub_config

SMALL = {"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 48}  # 4 to 48 tokens
RELEASED = {"shortest_edge": 65536, "longest_edge": 16777216}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


def _processor_tokens(width: int, height: int, size: dict) -> int:
    """Merge groups of an image by transformers' Qwen2VLImageProcessor as Qwen3-VL's
    preprocessor_config.json sets it up."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    proc = Qwen2VLImageProcessorPil(size=size, patch_size=16, merge_size=2,
                                    temporal_patch_size=2)  # fmt: skip
    image = Image.fromarray(image_array(width, height, (30, 90, 200)), "RGB")
    t, h, w = proc(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist()
    return t * h * w // 4


def _checkpoint(path: Path, preprocessor: dict | None) -> Path:
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(hub_config(big=False)))  # Qwen3-VL-2B's
    if preprocessor is not None:
        (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(corpus, 300, SPECIALS, byte_level=True))
    tok.chat_template = CHATML
    tok.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("size", [SMALL, RELEASED])
def test_tokens_per_image_match_the_image_processor(tmp_path: Path, size: dict) -> None:
    pre = {"size": size, "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
    spec = get_preset("qwen3-vl-8b")
    tiling = model_data_side(spec, _checkpoint(tmp_path / "ckpt", pre)).tiling
    assert (tiling.tile, tiling.min_pixels, tiling.max_pixels) == (
        32, size["shortest_edge"], size["longest_edge"])  # fmt: skip
    for width, height in SIZES:
        want = _processor_tokens(width, height, size)
        assert image_tiles(width, height, tiling, images_in_sample=2) == (want, want)


def test_without_a_preprocessor_file_the_released_settings_apply(tmp_path: Path) -> None:
    side = model_data_side(get_preset("qwen3-vl-8b"))
    bare = model_data_side(get_preset("qwen3-vl-8b"), _checkpoint(tmp_path / "ckpt", None))
    for t in (side.tiling, bare.tiling):
        assert (t.min_pixels, t.max_pixels) == (65536, 16777216)
        assert t.image_mean == t.image_std == (0.5, 0.5, 0.5)
    assert (side.family, side.template, side.dummy_tile) == ("qwen3_vl", "qwen2_vl", False)
    assert bare.template == "hf"
    assert (side.native_video.rule, side.native_video.min_pixels,
            side.native_video.max_pixels) == ("qwen3_vl", 4096, 25165824)  # fmt: skip


def test_stats_of_a_checkpoint_match_processor_and_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    _, recs = image_records(tmp_path, SIZES[:8])
    write_records(tmp_path / "data.json", recs)
    ckpt = _checkpoint(tmp_path / "ckpt", {"size": SMALL, "patch_size": 16, "merge_size": 2})
    out = tmp_path / "lengths.npz"
    assert cli_main(["stats", str(tmp_path / "data.json"), "--model", str(ckpt), "--out",
                     str(out), "--workers", "1", "--no-progress"]) == 0
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    want_vit, want_tokens = [], []
    for rec in recs:
        images = rec.get("image") or []
        images = [images] if isinstance(images, str) else images
        per_image = []
        for name in images:
            with Image.open(tmp_path / name) as img:
                per_image.append(_processor_tokens(*img.size, SMALL))
        messages, k = [], 0
        for turn in rec["conversations"]:
            text = turn["value"]
            while "<image>" in text:
                pads = "<|image_pad|>" * per_image[k]
                text = text.replace("<image>", f"<|vision_start|>{pads}<|vision_end|>", 1)
                k += 1
            messages.append({"role": {"human": "user", "gpt": "assistant"}[turn["from"]],
                             "content": text})
        ids = tok.apply_chat_template(messages, tokenize=True)
        want_vit.append(sum(per_image))
        want_tokens.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    stats = load_lengths(out)
    assert stats.vit.tolist() == want_vit and stats.tokens.tolist() == want_tokens
    stored = read_stats_config(out)
    assert stored["tiling"]["tile"] == 32 and stored["tiling"]["max_pixels"] == SMALL[
        "longest_edge"]  # fmt: skip
    assert stored["template"] == "hf" and not stored["dummy_tile"]


VIDEO_PRE = {"size": {"shortest_edge": 32 * 32 * 2, "longest_edge": 32 * 32 * 40}, "fps": 3,
             "min_frames": 4, "max_frames": 10, "patch_size": 16, "merge_size": 2,
             "temporal_patch_size": 2}  # fmt: skip


def _transformers_video(frames: int, fps: float, width: int, height: int, pre: dict
                        ) -> tuple[int, list[float], int]:
    """(merge groups, timestamps, merge groups per temporal patch) of a video by transformers'
    Qwen3VLVideoProcessor (its frames, its sizes) and Qwen3VLProcessor (its timestamps)."""
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    proc = Qwen3VLVideoProcessor(**pre)
    indices = proc.sample_frames(SimpleNamespace(total_num_frames=frames, fps=fps))
    patches = proc.get_num_of_video_patches(len(indices), height, width)
    stamps = Qwen3VLProcessor._calculate_timestamps(None, indices, fps, 2)
    return patches // 4, stamps, patches // 4 // len(stamps)


@pytest.mark.parametrize("cap", [False, True])
def test_the_video_rule_matches_transformers(cap: bool) -> None:
    """Frames, sizes (the limits over the whole video, or capped per frame), merge groups and
    timestamps of videos of odd lengths, rates and sizes."""
    from megatron_omnibal.data.native.qwen3_video import qwen3_video
    from megatron_omnibal.models.families.qwen3_vl.data import video_settings

    pre = {**VIDEO_PRE, "cap_pixels_per_frame": cap, "max_video_tokens": 6}
    settings = video_settings(pre, get_preset("qwen3-vl-8b").vit, "ckpt")
    for frames, fps, width, height in [(23, 10.0, 70, 46), (9, 4.0, 36, 100), (40, 25.0, 200, 30),
                                       (3, 30.0, 640, 480), (301, 29.97, 1280, 720),
                                       (7, 2.0, 31, 17), (120, 24.0, 20, 600)]:
        taken = qwen3_video(frames, fps, width, height, settings, 32, "v")
        units, stamps, per_frame = _transformers_video(frames, fps, width, height, pre)
        assert taken.units == units, (frames, fps, width, height)
        assert taken.timestamps == pytest.approx(stamps)
        assert (taken.height // 32) * (taken.width // 32) == per_frame


def test_video_stats_match_transformers_and_the_chat_template(tmp_path: Path) -> None:
    """Whole samples: the chat template with each video as Qwen3VLProcessor renders it (per
    temporal patch `<t seconds>` and its own `<|vision_start|>`, pads, `<|vision_end|>`); a
    one-frame video is a bad sample, named."""
    import av
    from transformers import AutoTokenizer

    from tests.helpers.video_files import write_video

    ckpt = _checkpoint(tmp_path / "ckpt", {"size": SMALL, "patch_size": 16, "merge_size": 2})
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PRE))
    media = tmp_path / "media"
    media.mkdir()
    write_video(media / "a.mp4", 23, fps=10, size=(70, 46), gop=5)
    write_video(media / "b.webm", 9, fps=4, size=(36, 100))
    write_video(media / "one.mp4", 1, fps=10)
    ask = [{"from": "human", "value": "<video>\nwhat is in this picture ?"},
           {"from": "gpt", "value": "a cat , 3 ."}]
    recs = [{"id": "a", "video": "media/a.mp4", "conversations": ask},
            {"id": "one", "video": "media/one.mp4", "conversations": ask},
            {"id": "two", "videos": ["media/b.webm", "media/a.mp4"], "conversations": [
                {"from": "human", "value": "<video> and <video> : the value ?"},
                {"from": "gpt", "value": "2"}]}]  # fmt: skip
    (tmp_path / "v.json").write_text(json.dumps(recs))
    out = tmp_path / "v.npz"
    assert cli_main(["stats", str(tmp_path / "v.json"), "--model", str(ckpt), "--image-root",
                     str(tmp_path), "--out", str(out), "--on-error", "skip", "--workers", "1",
                     "--no-progress"]) == 0  # fmt: skip
    skipped = json.loads((tmp_path / "v.skipped.json").read_text())["datasets"]["v"]["skipped"]
    assert [s["id"] for s in skipped] == ["one"]
    assert "one.mp4: 1 frame(s); Qwen3-VL takes at least 2" in skipped[0]["reason"]
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    want_units, want_tokens = [], []
    for rec in (recs[0], recs[2]):
        text_of, units = [], 0
        for name in rec.get("videos") or [rec["video"]]:
            with av.open(str(tmp_path / name)) as container:
                stream = container.streams.video[0]
                fps = float(stream.average_rate)
                size = (stream.codec_context.width, stream.codec_context.height)
                frames = sum(1 for _ in container.decode(video=0))
            n, stamps, per_frame = _transformers_video(frames, fps, *size, VIDEO_PRE)
            units += n
            text_of.append("<|vision_start|>" + "".join(
                f"<{t:.1f} seconds><|vision_start|>" + "<|video_pad|>" * per_frame
                + "<|vision_end|>" for t in stamps) + "<|vision_end|>")  # fmt: skip
        messages = []
        for turn in rec["conversations"]:
            text = turn["value"]
            for video in text_of:
                text = text.replace("<video>", video, 1)
            messages.append({"role": {"human": "user", "gpt": "assistant"}[turn["from"]],
                             "content": text})
        ids = tok.apply_chat_template(messages, tokenize=True)
        want_units.append(units)
        want_tokens.append(len(ids["input_ids"] if hasattr(ids, "keys") else ids))
    stats = load_lengths(out)
    assert stats.vit.tolist() == want_units and stats.tokens.tolist() == want_tokens
    assert read_stats_config(out)["native_video"]["rule"] == "qwen3_vl"
