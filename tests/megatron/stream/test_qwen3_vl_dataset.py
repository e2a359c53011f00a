"""Qwen3-VL on a real image and video dataset: the loader's samples against transformers.

A tiny Qwen3-VL's config.json (tests/helpers/qwen3_vl.py: 4 px patches merged 2 x 2, so 8 px
merge groups) with its processor settings, generated images and videos of odd sizes, rates and
lengths (an odd frame count among them), a tokenizer whose vision tokens are the model's ids
and a ChatML chat template. Each sample's tokens equal the chat template's over the text
Qwen3VLProcessor writes (a video: per temporal patch `<t seconds>` and its own vision start,
pads and end); its patches and grids equal transformers' image processor's (images) and its
video processor's code (frames it samples, its size, its patchify with the last frame
repeated) on every frame PyAV decodes, one (1, h, w) grid per temporal patch; the counts are
the length file's."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_omnibal.cli import main as cli_main
from megatron_omnibal.data.formats.generate import image_array, save_image, train_tokenizer
from megatron_omnibal.data.lengths import load_lengths
from megatron_omnibal.megatron.stream.dataset import open_source
from megatron_omnibal.megatron.stream.source import SourceSettings
from megatron_omnibal.models.resolve import resolve_model
from tests.data.stats.test_qwen25vl_stats import CHATML, WORDS
from tests.helpers import qwen3_vl
from tests.helpers.video_files import write_video

PRE = {"size": {"shortest_edge": 8 * 8 * 4, "longest_edge": 8 * 8 * 16}, "patch_size": 4,
       "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5],
       "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
VIDEO_PRE = {"size": {"shortest_edge": 8 * 8 * 2, "longest_edge": 8 * 8 * 60}, "fps": 3,
             "min_frames": 4, "max_frames": 9, "patch_size": 4, "merge_size": 2,
             "temporal_patch_size": 2}  # fmt: skip
IDS = {"<|vision_end|>": 252, "<|vision_start|>": 253, "<|video_pad|>": 254, "<|image_pad|>": 255}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


def _tokenizer(ckpt: Path) -> None:
    """Words, timestamps and ChatML marks, fillers up to id 251, the model's vision tokens."""
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    corpus += [f"<{k / 10:.1f} seconds>" for k in range(100)]
    tok = train_tokenizer(corpus, 140, ["<unk>", "<|im_start|>", "<|im_end|>"])
    tok.add_tokens([f"filler{k}" for k in range(252 - tok.get_vocab_size())])
    tok.add_special_tokens(list(IDS))
    assert {t: tok.token_to_id(t) for t in IDS} == IDS
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    hf.chat_template = CHATML
    hf.save_pretrained(str(ckpt))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_data")
    ckpt = root / "ckpt"
    config = qwen3_vl.hf_config()  # the loader reads config.json, never the weights
    config.text_config.num_hidden_layers = 3
    config.save_pretrained(ckpt)
    (ckpt / "preprocessor_config.json").write_text(json.dumps(PRE))
    (ckpt / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PRE))
    _tokenizer(ckpt)
    (root / "m").mkdir()
    nrng = np.random.default_rng(1)
    for k, (w, h) in enumerate([(37, 90), (61, 23), (120, 77)]):
        save_image(root / f"m/{k}.png", image_array(w, h, noise=256, rng=nrng))
    write_video(root / "m/a.mp4", 23, fps=10, size=(70, 46), gop=5)  # 6 frames taken
    write_video(root / "m/b.webm", 9, fps=4, size=(36, 100))  # 6
    write_video(root / "m/c.mkv", 50, fps=25, size=(100, 30))  # 4
    write_video(root / "m/d.mp4", 33, fps=10, size=(40, 40))  # 9: the last frame repeated
    ask = lambda first: [{"from": "human", "value": first + "what is in this picture ?"},  # noqa: E731
                         {"from": "gpt", "value": "a cat , 3 ."}]  # fmt: skip
    recs = [{"id": "img", "image": "m/0.png", "conversations": ask("<image>\n")},
            {"id": "imgs", "image": ["m/1.png", "m/2.png"],
             "conversations": ask("<image> and <image>\n")},
            {"id": "vid", "video": "m/a.mp4", "conversations": ask("<video>\n")},
            {"id": "odd", "video": "m/d.mp4", "conversations": ask("<video>\n")},
            {"id": "two", "videos": ["m/b.webm", "m/c.mkv"],
             "conversations": ask("<video> and <video>\n")},
            {"id": "text", "conversations": ask("")}]  # fmt: skip
    (root / "data.json").write_text(json.dumps(recs))
    lengths = root / "lengths.npz"
    assert cli_main(["stats", str(root / "data.json"), "--model", str(ckpt), "--out",
                     str(lengths), "--workers", "1", "--no-progress"]) == 0  # fmt: skip
    return SimpleNamespace(root=root, ckpt=ckpt, recs=recs, lengths=lengths)


def _video(path: Path) -> tuple[np.ndarray, int, int, int, list[float]]:
    """(patches, temporal patches, h, w in patches, timestamps) of a video by transformers'
    Qwen3-VL video processor code on every frame PyAV decodes (resized with PIL bicubic, as
    the loader does; transformers resizes with torchvision)."""
    import av
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        smart_resize,
    )

    with av.open(str(path)) as container:
        fps = float(container.streams.video[0].average_rate)
        every = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    proc = Qwen3VLVideoProcessor(**VIDEO_PRE)
    picked = proc.sample_frames(SimpleNamespace(total_num_frames=len(every), fps=fps))
    height, width = every[0].shape[:2]
    size = VIDEO_PRE["size"]
    h, w = smart_resize(len(picked), height, width, 2, 8, size["shortest_edge"],
                        size["longest_edge"])  # fmt: skip
    frames = np.stack([np.asarray(Image.fromarray(every[k]).resize(
        (w, h), Image.Resampling.BICUBIC)) for k in picked]).astype(np.float32)  # fmt: skip
    frames = (frames / 255.0 - 0.5) / 0.5
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)[None]
    patches, t, gh, gw = proc.patchify(video, patch_size=4, merge_size=2, temporal_patch_size=2)
    stamps = Qwen3VLProcessor._calculate_timestamps(None, picked, fps, 2)
    return patches[0].numpy(), t, gh, gw, stamps


def test_samples_carry_the_processors_tokens_patches_and_grids(data) -> None:
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tok = AutoTokenizer.from_pretrained(str(data.ckpt))
    images = Qwen2VLImageProcessorPil(**PRE)
    settings = SourceSettings(data=str(data.root / "data.json"), tokenizer=None,
                              lengths_path=str(data.lengths), text_scale=1)
    lengths = load_lengths(data.lengths)
    source = open_source(settings, lengths, resolve_model(str(data.ckpt)))
    for i, rec in enumerate(data.recs):
        s = source(i)
        names = rec.get("image") or []
        names = [names] if isinstance(names, str) else names
        videos = rec.get("videos") or ([rec["video"]] if "video" in rec else [])
        texts, patches, grids = [], [], []
        if names:
            ref = images(images=[Image.open(data.root / n).convert("RGB") for n in names],
                         return_tensors="np")  # fmt: skip
            patches.append(ref["pixel_values"])
            grids += ref["image_grid_thw"].tolist()
            texts = ["<|vision_start|>" + "<|image_pad|>" * int(np.prod(g) // 4)
                     + "<|vision_end|>" for g in grids]  # fmt: skip
        for v in videos:
            values, t, gh, gw, stamps = _video(data.root / v)
            assert len(stamps) == t
            patches.append(values)
            grids += [[1, gh, gw]] * t
            texts.append("<|vision_start|>" + "".join(
                f"<{x:.1f} seconds><|vision_start|>" + "<|video_pad|>" * (gh * gw // 4)
                + "<|vision_end|>" for x in stamps) + "<|vision_end|>")  # fmt: skip
        messages = []
        for turn in rec["conversations"]:
            text = turn["value"]
            for media in texts:
                text = text.replace("<video>" if videos else "<image>", media, 1)
            messages.append({"role": {"human": "user", "gpt": "assistant"}[turn["from"]],
                             "content": text})
        ids = tok.apply_chat_template(messages, tokenize=True)
        ids = torch.tensor(ids["input_ids"] if hasattr(ids, "keys") else ids)
        want = torch.where(ids == IDS["<|video_pad|>"], IDS["<|image_pad|>"], ids)
        assert torch.equal(s.tokens, want), rec["id"]
        assert len(s.tokens) == lengths.tokens[i] and lengths.vit[i] == int(
            (want == IDS["<|image_pad|>"]).sum()), rec["id"]  # fmt: skip
        assert s.image_grid.tolist() == grids, rec["id"]
        if patches:
            np.testing.assert_allclose(s.images.numpy(), np.concatenate(patches), rtol=0,
                                       atol=1e-5, err_msg=rec["id"])  # fmt: skip
        seconds = s.grid_seconds.tolist()
        assert len(seconds) == len(grids) and all((x > 0) == bool(videos) for x in seconds)
