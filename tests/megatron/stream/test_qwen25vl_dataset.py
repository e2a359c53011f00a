"""Qwen2.5-VL on a real image and video dataset: the loader's samples against transformers' image
processor, its video processor's rules and `omnibal stats`, and training through the entry point
with the vision tower over two pipeline stages against one stage.

A tiny random Qwen2.5-VL (tests/helpers/hf_models.py, its processor settings in
preprocessor_config.json with their own mean and std, its video settings in
video_preprocessor_config.json), generated images of odd sizes (one image, two images, text
only, a truncated JPEG whose header is intact), generated videos of odd sizes and rates (one
video, a clip, two videos in a sample, a truncated WebM whose header is intact) and a tokenizer
trained on the fly whose image token ids are the model's.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_omnibal.cli import main as cli_main
from megatron_omnibal.data.formats.generate import image_array, save_image, train_tokenizer
from megatron_omnibal.data.lengths import load_lengths, read_stats_config
from megatron_omnibal.data.native.video import NativeVideoSettings
from megatron_omnibal.megatron.stream.batch import collate, is_shape_only
from megatron_omnibal.megatron.stream.dataset import open_source
from megatron_omnibal.megatron.stream.loader import SampleLoadError
from megatron_omnibal.megatron.stream.source import SourceSettings
from megatron_omnibal.models.resolve import resolve_model
from tests.data.native.test_qwen25vl_video import transformers_video
from tests.helpers import hf_models
from tests.helpers.video_files import write_video

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_ranks  # noqa: E402
from run_records import head_micro, records  # noqa: E402

WORKER = Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers" / "train_record.py"
WORDS = ["the", "a", "cat", "chart", "shows", "value", "of", "year", "what", "is", "in", "this",
         "picture", "answer", "1", "2", "3", ",", ".", "?"]
SIZES = [(37, 90), (333, 51), (199, 13), (28, 28), (14, 42), (200, 150), (97, 30), (61, 100)]
PRE = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16, "patch_size": 14,
       "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5, 0.4, 0.3],
       "image_std": [0.2, 0.3, 0.25]}  # fmt: skip
VIDEO = NativeVideoSettings(fps=2.0, min_frames=4, max_frames=8, min_pixels=28 * 28 * 2,
                            max_pixels=28 * 28 * 6, max_video_tokens=60,
                            image_mean=(0.3, 0.3, 0.4), image_std=(0.25, 0.2, 0.3))  # fmt: skip
VIDEO_PRE = {"fps": VIDEO.fps, "min_frames": VIDEO.min_frames, "max_frames": VIDEO.max_frames,
             "min_pixels": VIDEO.min_pixels, "max_pixels": VIDEO.max_pixels,
             "max_video_tokens": VIDEO.max_video_tokens, "image_mean": list(VIDEO.image_mean),
             "image_std": list(VIDEO.image_std)}  # fmt: skip


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


def _tokenizer(path: Path) -> None:
    """Words, ChatML marks, fillers up to id 149, then the model's image tokens (150-153)."""
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    tok = train_tokenizer(corpus, 140, ["<unk>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens([f"filler{k}" for k in range(150 - tok.get_vocab_size())])
    tok.add_special_tokens(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>",
                            "<|vision_end|>"])  # fmt: skip
    assert tok.token_to_id("<|image_pad|>") == hf_models.QWEN_IMAGE
    tok.save(str(path))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_data")
    ckpt = hf_models.qwen2_5_vl(root / "ckpt").path
    (ckpt / "preprocessor_config.json").write_text(json.dumps(PRE))
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PRE))
    _tokenizer(root / "tok.json")
    (root / "img").mkdir()
    rng, nrng = random.Random(1), np.random.default_rng(1)
    names = []
    for k, (w, h) in enumerate(SIZES):
        names.append(f"img/{k}.{'png' if k % 2 else 'jpg'}")
        save_image(root / names[-1], image_array(w, h, noise=256, rng=nrng))
    full = (root / names[0]).read_bytes()
    (root / "img" / "cut.jpg").write_bytes(full[: len(full) // 2])

    def turns(first: str) -> list[dict]:
        words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
        return [{"from": "human", "value": first + words(5)}, {"from": "gpt", "value": words(6)}]

    recs = [{"id": f"s{k}", "image": n, "conversations": turns("<image>\n")}
            for k, n in enumerate(names * 2)]
    recs[3]["image"] = names[:2]
    recs[3]["conversations"][0]["value"] = "<image> and <image> ?"
    recs[5] = {"id": "text", "conversations": turns("")}
    recs[9] = {"id": "cut", "image": "img/cut.jpg", "conversations": turns("<image>\n")}
    (root / "vid").mkdir()
    write_video(root / "vid/a.mp4", 23, fps=10, size=(70, 46), gop=5)
    write_video(root / "vid/b.webm", 9, fps=4, size=(36, 100))
    write_video(root / "vid/c.mkv", 30, fps=25, size=(100, 30))
    write_video(root / "vid/cut.mp4", 40, fps=10, size=(64, 48),
                container_options={"movflags": "faststart"})  # 40 frames promised up front
    cut = (root / "vid/cut.mp4").read_bytes()
    (root / "vid/cut.mp4").write_bytes(cut[: len(cut) // 2])
    recs[2] = {"id": "vid", "video": "vid/a.mp4", "conversations": turns("<video>\n")}
    recs[6] = {"id": "clip", "video": "vid/a.mp4", "clip": [0.4, 1.9],
               "conversations": turns("<video>\n")}
    recs[11] = {"id": "twovid", "videos": ["vid/b.webm", "vid/c.mkv"],
                "conversations": turns("<video> and <video> ?")}
    recs[13] = {"id": "cutvid", "video": "vid/cut.mp4", "conversations": turns("<video>\n")}
    (root / "data.json").write_text(json.dumps(recs))
    lengths = root / "lengths.npz"
    assert cli_main(["stats", str(root / "data.json"), "--model", str(ckpt), "--tokenizer",
                     str(root / "tok.json"), "--template", "qwen2_vl", "--out", str(lengths),
                     "--workers", "1", "--no-progress"]) == 0  # fmt: skip
    return SimpleNamespace(root=root, ckpt=ckpt, recs=recs, lengths=lengths)


def _source(data, pixels: bool = True):
    settings = SourceSettings(data=str(data.root / "data.json"), tokenizer=None,
                              lengths_path=str(data.lengths), text_scale=1)
    return open_source(settings, load_lengths(data.lengths), resolve_model(str(data.ckpt)),
                       pixels=pixels)


def _processor(images: list[str], root: Path) -> dict:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil(**PRE)
    return processor(images=[Image.open(root / n).convert("RGB") for n in images],
                     return_tensors="np")


def test_samples_carry_the_processors_patches_and_grids(data) -> None:
    """Each sample's patches and grids equal the image processor's with the checkpoint's
    settings; its placeholders and merge groups are the length file's; a rank without pixels
    builds the same tokens, labels and grids from the headers alone (shape-only patches); the
    truncated image fails only where it is decoded. Videos: patches, grids and seconds per
    temporal patch equal transformers' video processor code on every frame PyAV decodes; the
    truncated video fails only where it is decoded."""
    stored = read_stats_config(data.lengths)["tiling"]
    assert (stored["image_mean"], stored["image_std"]) == (PRE["image_mean"], PRE["image_std"])
    lengths = load_lengths(data.lengths)
    first, later = _source(data), _source(data, pixels=False)
    for i, rec in enumerate(data.recs):
        names = rec.get("image") or []
        names = [names] if isinstance(names, str) else names
        other = later(i)
        if rec["id"] in ("cut", "cutvid"):
            with pytest.raises(SampleLoadError, match=r"id cut.*(cannot decode image|cut.mp4 "
                                                      "(ends after frame .* truncated|fails "
                                                      "while decoding))"):
                first(i)
            assert is_shape_only(other.images)
            continue
        s = first(i)
        units = int((s.tokens == hf_models.QWEN_IMAGE).sum())
        assert units == lengths.vit[i] and len(s.tokens) == lengths.tokens[i], i
        assert torch.equal(other.tokens, s.tokens) and torch.equal(other.labels, s.labels)
        assert torch.equal(other.image_grid, s.image_grid), i
        assert torch.equal(other.grid_seconds, s.grid_seconds), i
        assert other.images.shape == s.images.shape
        videos = rec.get("videos") or ([rec["video"]] if "video" in rec else [])
        if videos:
            refs = [transformers_video(data.root / v, rec.get("clip"), VIDEO) for v in videos]
            assert s.image_grid.tolist() == [r[1] for r in refs], i
            np.testing.assert_allclose(s.grid_seconds.numpy(), [r[2] for r in refs], rtol=1e-6)
            np.testing.assert_allclose(s.images.numpy(), np.concatenate([r[0] for r in refs]),
                                       rtol=0, atol=1e-5)  # fmt: skip
            assert is_shape_only(other.images) and s.image_flags.tolist() == [1] * len(videos)
            continue
        if not names:
            assert s.images.shape == (0, 1176) and s.image_grid.shape == (0, 3)
            continue
        assert is_shape_only(other.images)
        ref = _processor(names, data.root)
        assert s.image_grid.tolist() == ref["image_grid_thw"].tolist(), i
        np.testing.assert_allclose(s.images.numpy(), ref["pixel_values"], rtol=0, atol=1e-5)
        assert s.image_flags.tolist() == [1] * len(names)
    batch = collate([first(i) for i in (0, 3, 5, 11)])  # packs the grids in sequence order
    assert batch.image_grid.tolist()[:3] == _processor(
        [data.recs[0]["image"], *data.recs[3]["image"]], data.root)["image_grid_thw"].tolist()
    assert batch.image_grid[3:, 0].tolist() == [2, 2] and batch.grid_seconds[:3].sum() == 0


@pytest.mark.megatron
def test_two_stage_tower_trains_like_one_stage_and_skips_the_bad_image(data, tmp_path) -> None:
    """One epoch through torchrun, the same weights (set from each parameter's name): the
    vision tower over two stages (2 + 2 blocks, LLM 0 + 4 layers) reads the same micro-batches
    and gives the same loss of every micro-batch as one stage, videos included (their M-RoPE
    ids and per-temporal-patch attention on every stage); the truncated image's and video's
    samples are left out and reported on both, and every micro-batch holds its budget of merge
    groups."""
    from megatron_omnibal.balance.config import BalanceConfig
    from megatron_omnibal.balance.sampler import BalancedBatchSampler

    lengths = load_lengths(data.lengths)
    vit_budget, token_budget = 2 * int(lengths.vit.max()), 2 * int(lengths.tokens.max())
    config = BalanceConfig(dp_size=1, micro_batches=2, vit_budget=vit_budget,
                           token_budget=token_budget, seed=5)
    steps = BalancedBatchSampler(lengths, config, dp_rank=0).steps_per_epoch
    flags = ["--omnibal", "--omnibal-model", str(data.ckpt), "--omnibal-lengths",
             str(data.lengths), "--omnibal-data", str(data.root / "data.json"),
             "--omnibal-vit-budget", str(vit_budget), "--omnibal-token-budget",
             str(token_budget), "--micro-batch-size", "1", "--global-batch-size", "2",
             "--train-iters", str(steps), "--lr", "1e-3", "--transformer-impl", "local",
             "--seed", "5", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--num-workers", "1", "--omnibal-bad-sample", "skip"]  # fmt: skip
    runs = {}
    for name, nproc, vit, llm in (("pp2", 2, "2,2", "0,4"), ("pp1", 1, "4", "4")):
        out = tmp_path / name
        pp = ["--pipeline-model-parallel-size", "2"] if nproc == 2 else []
        code, _, err = run_ranks(WORKER, nproc, [
            str(out), *flags, *pp, "--omnibal-vit-pp-layers", vit, "--omnibal-llm-pp-layers",
            llm, "--omnibal-bad-sample-report", str(tmp_path / f"{name}.jsonl")],
            timeout=400, env={"OMNIBAL_TEST_WEIGHTS": "7"})  # fmt: skip
        assert code == 0, err[-5000:]
        runs[name] = head_micro(records(out))
        skipped = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert sorted((e["index"], "id cut" in e["sample"]) for e in skipped) == [
            (9, True), (13, True)], name  # the truncated image and video
    two, one = runs["pp2"], runs["pp1"]
    assert [m["indices"] for m in two] == [m["indices"] for m in one] and len(two) == 2 * steps
    assert sorted(i for m in two for i in m["indices"]) == list(range(len(lengths)))
    for a, b in zip(two, one, strict=True):
        assert lengths.vit[a["indices"]].sum() <= vit_budget
        assert a["tokens"] == b["tokens"] > 0
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["indices"]
