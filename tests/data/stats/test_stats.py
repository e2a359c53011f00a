"""`omnibal stats` end to end on a real small dataset, against an independent computation.

The dataset is built on the fly: PNG/JPEG files of varied sizes written with Pillow, LLaVA/InternVL
records (single image with and without placeholder, several images, text-only, system turns,
multi-turn), and a BPE tokenizer trained on the fly with `tokenizers`. The oracle reads image
sizes with Pillow, tiles by enumerating grids, spells every image token out in the text and
tokenizes the rendered conversation in one piece with transformers.
"""

import json
import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from megatron_omnibal.cli import main as cli_main
from megatron_omnibal.data.formats.generate import (
    TEMPLATE_SPECIALS,
    image_array,
    save_image,
    train_tokenizer,
)
from megatron_omnibal.data.images.tiling import DEFAULT_PINPOINTS, TilingConfig
from megatron_omnibal.data.lengths import load_lengths
from megatron_omnibal.data.sample.config import StatsConfig
from megatron_omnibal.data.stats.compute import StatsError, compute_stats, write_outputs
from megatron_omnibal.data.text.conversations import INTERNVL_SYSTEM, LLAVA_IMAGE, VICUNA_SYSTEM

WORDS = ["the", "a", "cat", "dog", "image", "chart", "shows", "value", "of", "year", "red",
         "blue", "what", "is", "in", "this", "picture", "answer", "question", "table", "left",
         "right", "number", "text", "page", "total", "1", "2", "3", "4", "5", ",", ".", "?"]
SIZES = [(100, 100), (800, 600), (1920, 1080), (300, 2000), (448, 448), (1000, 1000),
         (2500, 400), (37, 900), (640, 480), (1344, 896), (5, 4), (1200, 1300)]
IMAGE_SPECIALS = ["<img>", "</img>", "<IMG_CONTEXT>", "<image>"]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


def _words(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(lo, hi)))


def _records(rng, n, images):
    recs = []
    for i in range(n):
        kind = i % 7
        human = _words(rng, 2, 40)
        conv = [{"from": "human", "value": human}, {"from": "gpt", "value": _words(rng, 1, 60)}]
        rec = {"id": f"s{i}", "conversations": conv}
        if kind in (0, 1):  # one image, placeholder given (front or middle)
            rec["image"] = rng.choice(images)
            conv[0]["value"] = ("<image>\n" + human) if kind == 0 else f"{human} <image> ok"
        elif kind == 2:  # one image, no placeholder: the loader puts one in front
            rec["image"] = rng.choice(images)
        elif kind == 3:  # several images, placeholders spread over two human turns
            rec["image"] = rng.sample(images, 3)
            conv[0]["value"] = "<image>\n<image>\n" + human
            conv += [{"from": "human", "value": "and <image>?"}, {"from": "gpt", "value": "no"}]
        elif kind == 4:  # text only, multi-turn
            conv += [{"from": "human", "value": _words(rng, 1, 9)},
                     {"from": "gpt", "value": _words(rng, 1, 9)}]
        elif kind == 5:  # own system message
            rec["image"] = rng.choice(images)
            conv.insert(0, {"from": "system", "value": "you answer " + _words(rng, 1, 5)})
        else:  # text only, empty image list
            rec["image"] = []
        recs.append(rec)
    return recs


def _train_tokenizer(rng):
    corpus = [_words(rng, 5, 40) for _ in range(400)]
    return train_tokenizer(corpus, vocab_size=400, special_tokens=TEMPLATE_SPECIALS[1:],
                           byte_level=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("stats")
    rng = random.Random(0)
    (root / "img").mkdir()
    images = []
    for k, (w, h) in enumerate(SIZES):
        name = f"img/{k}.{'png' if k % 2 else 'jpg'}"
        save_image(root / name, image_array(w, h, (k * 20, 90, 200)))
        images.append(name)
    tok = _train_tokenizer(rng)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                        "<|im_end|>\n{% endfor %}")
    hf.save_pretrained(str(root / "tok"))
    bos = _train_tokenizer(random.Random(0))
    bos.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos.token_to_id("<s>"))])
    bos.save(str(root / "bos_tokenizer.json"))
    recs = _records(rng, 49, images)
    (root / "data.json").write_text(json.dumps(recs, indent=1, ensure_ascii=False))
    return SimpleNamespace(root=root, images=images, recs=recs, tok_dir=str(root / "tok"),
                           tok_bos=str(root / "bos_tokenizer.json"))


@pytest.fixture(scope="module")
def oracle_tok(data):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(data.tok_dir)
    tok.add_tokens(IMAGE_SPECIALS, special_tokens=True)
    return tok


def _internvl_tiles(w, h, max_tiles, tile=448):
    """Enumerate grids: nearest aspect ratio; ties go to the biggest grid under 2x the image."""
    grids = sorted(((c, r) for c in range(1, 13) for r in range(1, 13) if c * r <= max_tiles),
                   key=lambda g: (g[0] * g[1], g[0]))
    best = min(abs(w / h - c / r) for c, r in grids)
    ties = [g for g in grids if abs(w / h - g[0] / g[1]) == best]
    fits = [g for g in ties if w * h > 0.5 * tile * tile * g[0] * g[1]]
    c, r = fits[-1] if fits and fits[0] == ties[0] else ties[0]
    return c * r + (c * r > 1)


def _hf_llava_next_tokens(w, h):
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    unpadded = LlavaNextProcessor._get_unpadded_features
    proc = SimpleNamespace(
        image_processor=SimpleNamespace(image_grid_pinpoints=[list(p) for p in DEFAULT_PINPOINTS]),
        patch_size=14, num_additional_image_tokens=0,
        _get_unpadded_features=lambda *a: unpadded(None, *a))
    return LlavaNextProcessor._get_number_of_features(proc, h, w, 336, 336)


def _oracle(rec, root, tok, model="internvl", max_tiles=12, dummy=True, bos=0):
    """(vit_num, token_num, image_flags) of one record, computed directly."""
    images = rec.get("image") or []
    images = [images] if isinstance(images, str) else images
    sizes = []
    for path in images:
        with Image.open(root / path) as img:
            sizes.append(img.size)
    turns = [(m["from"], m["value"]) for m in rec["conversations"]]
    if isinstance(rec.get("image"), str) and "<image>" not in turns[1 if turns[0][0] == "system"
                                                                     else 0][1]:
        k = 1 if turns[0][0] == "system" else 0
        turns[k] = (turns[k][0], "<image>\n" + turns[k][1])
    if model == "internvl":
        share = max(1, max_tiles // max(1, len(images)))
        tiles = [_internvl_tiles(w, h, share) for w, h in sizes]
        spelled = [f"<img>{'<IMG_CONTEXT>' * (256 * t)}</img>" for t in tiles]
    elif model == "llava15":
        tiles = [1] * len(sizes)
        spelled = ["<image>" * 576] * len(sizes)
    else:
        from transformers.image_processing_utils import select_best_resolution

        grids = [select_best_resolution((h, w), [list(p) for p in DEFAULT_PINPOINTS])
                 for w, h in sizes]
        tiles = [gh // 336 * (gw // 336) + 1 for gh, gw in grids]
        spelled = ["<image>" * _hf_llava_next_tokens(w, h) for w, h in sizes]
    # the k-th placeholder of the human turns becomes the k-th image's tokens
    text = "\x00".join(v for _, v in turns).replace("<image>", "\x01")
    for s in spelled:
        text = text.replace("\x01", s, 1)
    values = text.split("\x00")
    turns = [(r, v) for (r, _), v in zip(turns, values, strict=True)]
    if model == "internvl":
        system = turns.pop(0)[1] if turns[0][0] == "system" else INTERNVL_SYSTEM
        role = {"human": "user", "gpt": "assistant"}
        full = f"<|im_start|>system\n{system}<|im_end|>\n" + "".join(
            f"<|im_start|>{role[r]}\n{v}<|im_end|>\n" for r, v in turns)
        n_tokens = len(tok(full)["input_ids"]) + bos
    elif model == "llava15":
        system = turns.pop(0)[1] if turns[0][0] == "system" else VICUNA_SYSTEM
        full = system + " " + "".join(f"USER: {v} " if r == "human" else f"ASSISTANT: {v}</s>"
                                      for r, v in turns)
        n_tokens = len(tok(full)["input_ids"])
    else:  # llava_next with the tokenizer's own chat template
        role = {"human": "user", "gpt": "assistant", "system": "system"}
        ids = tok.apply_chat_template([{"role": role[r], "content": v} for r, v in turns],
                                      tokenize=True)
        n_tokens = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
    n_tiles = sum(tiles)
    return (n_tiles if images else int(dummy)), n_tokens, n_tiles


def _check(stats, expected):
    exp = np.array(expected, dtype=np.int64).reshape(-1, 3)
    assert stats.vit.tolist() == exp[:, 0].tolist()
    assert stats.tokens.tolist() == exp[:, 1].tolist()
    assert stats.image_flags.tolist() == exp[:, 2].tolist()


def test_internvl_counts_match_direct_computation_with_two_workers(data, oracle_tok):
    config = StatsConfig(tokenizer=data.tok_dir)
    result = compute_stats(data.root / "data.json", config, workers=2, chunk_size=5,
                           progress=False)
    assert result.added_tokens == ["<img>", "<IMG_CONTEXT>", "</img>"]
    assert not result.skipped and result.records == [len(data.recs)]
    _check(result.stats, [_oracle(r, data.root, oracle_tok) for r in data.recs])
    # the dataset exercises what it should: multi-tile images, multi-image and text-only samples
    assert result.stats.vit.max() >= 13 and (result.stats.image_flags == 0).sum() >= 10


def test_tokenizer_file_with_bos_and_no_dummy_tile(data, oracle_tok):
    config = StatsConfig(tokenizer=data.tok_bos, dummy_tile=False,
                         tiling=TilingConfig(max_tiles=6, thumbnail=True))
    result = compute_stats(data.root / "data.json", config, progress=False)
    _check(result.stats, [_oracle(r, data.root, oracle_tok, max_tiles=6, dummy=False, bos=1)
                          for r in data.recs])
    assert (result.stats.vit == 0).sum() == (result.stats.image_flags == 0).sum() > 0


def test_llava15_vicuna_and_llava_next_hf_template(data, oracle_tok):
    recs = [r for r in data.recs if not isinstance(r.get("image"), list) or not r["image"]
            or len(r["image"]) == 1]  # LLaVA-1.5/NeXT samples hold one image
    (data.root / "llava.json").write_text(json.dumps(recs))
    llava15 = StatsConfig(tokenizer=data.tok_dir, template="vicuna_v1", image_style=LLAVA_IMAGE,
                          tiling=TilingConfig(mode="fixed", tile=336, tokens_per_tile=576))
    result = compute_stats(data.root / "llava.json", llava15, progress=False)
    _check(result.stats, [_oracle(r, data.root, oracle_tok, "llava15") for r in recs])
    nxt = StatsConfig(tokenizer=data.tok_dir, template="hf", image_style=LLAVA_IMAGE,
                      tiling=TilingConfig(mode="anyres", tile=336, tokens_per_tile=576))
    result = compute_stats(data.root / "llava.json", nxt, progress=False)
    _check(result.stats, [_oracle(r, data.root, oracle_tok, "llava_next") for r in recs])
    assert result.stats.vit.max() >= 3


def test_meta_input_per_dataset_files_and_round_trip(data, oracle_tok, tmp_path):
    first, second = data.recs[:20], data.recs[20:]
    for name, recs in (("a", first), ("b", second)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    meta = {"docs/a": {"root": str(data.root), "annotation": "a.jsonl", "repeat_time": 2,
                       "max_dynamic_patch": 4, "data_augment": False},
            "b": {"root": str(data.root), "annotation": "b.jsonl", "repeat_time": 0.5}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    result = compute_stats(tmp_path / "meta.json", StatsConfig(tokenizer=data.tok_dir),
                           workers=2, chunk_size=8, progress=False)
    out = tmp_path / "out" / "lengths.json"
    written = write_outputs(result, out, fmt="npz")
    assert [p.name for p in written] == ["lengths.json", "docs_a_token_lengths.npz",
                                         "b_token_lengths.npz", "lengths.skipped.json"]
    back = load_lengths(out)
    a = [_oracle(r, data.root, oracle_tok, max_tiles=4) for r in first]
    b = [_oracle(r, data.root, oracle_tok) for r in second[:len(second) // 2]]
    _check(back, a + a + b)
    assert back.names == ("docs/a", "b")
    assert back.dataset.tolist() == [0] * 40 + [1] * len(b)
    report = json.loads((tmp_path / "out" / "lengths.skipped.json").read_text())
    assert report["datasets"]["docs/a"]["length_entries"] == 40
    assert report["datasets"]["b"]["records"] == len(b)


def _bad_dataset(data, tmp_path):
    """Good records with bad ones mixed in, as JSONL; returns (path, good indices, bad)."""
    Image.new("RGB", (10, 10)).save(tmp_path / "ok.png")
    (tmp_path / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00")
    good = data.recs[:12]
    conv = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]
    bad = {
        2: ({"id": "m", "image": "img/missing.png", "conversations": conv}, "cannot read image"),
        5: ({"id": "c", "image": str(tmp_path / "corrupt.jpg"), "conversations": conv},
            "corrupt image"),
        6: ({"id": "g", "conversations": conv[::-1]}, "expected 'human', got 'gpt'"),
        9: ({"id": "p", "image": ["img/0.jpg", "img/1.png"], "conversations": conv},
            "2 image.* but 0 '<image>' placeholder"),
        11: ("{not json", "invalid JSON"),
        13: ({"id": "long", "conversations": [{"from": "human", "value": "cat, dog? " * 4000},
                                              {"from": "gpt", "value": "ok"}]}, "over-long"),
        15: ({"id": "v", "video": "clip.mp4", "conversations": conv},
             "cannot open video .*clip.mp4: no such file"),
    }
    lines, good_recs = [], iter(good)
    for i in range(19):
        if i in bad:
            rec = bad[i][0]
            lines.append(rec if isinstance(rec, str) else json.dumps(rec))
        else:
            lines.append(json.dumps(next(good_recs)))
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, good, bad


def test_bad_samples_stop_the_run_or_are_listed_as_skipped(data, oracle_tok, tmp_path):
    path, good, bad = _bad_dataset(data, tmp_path)
    config = StatsConfig(tokenizer=data.tok_dir, max_tokens=8000)
    with pytest.raises(StatsError) as err:
        compute_stats(path, config, image_root=data.root, chunk_size=4, progress=False)
    # the first chunk's bad sample is named with file, line and id
    assert f"{path}:3: sample 2 (id m): cannot read image" in str(err.value)
    result = compute_stats(path, config, image_root=data.root, on_error="skip", workers=2,
                           chunk_size=4, progress=False)
    assert [(s.index, s.line) for s in result.skipped] == [(i, i + 1) for i in sorted(bad)]
    for s in result.skipped:
        assert s.id == (None if s.index == 11 else bad[s.index][0]["id"])
        assert re.search(bad[s.index][1], s.reason), s.reason
    _check(result.stats, [_oracle(r, data.root, oracle_tok) for r in good])
    written = write_outputs(result, tmp_path / "mixed.npz")
    report = json.loads(written[-1].read_text())["datasets"]["mixed"]
    assert [s["line"] for s in report["skipped"]] == [i + 1 for i in sorted(bad)]
    assert report["records"] == 19 and report["length_entries"] == len(good)
    assert len(load_lengths(tmp_path / "mixed.npz")) == len(good)


def test_cli_writes_a_loadable_length_file(data, oracle_tok, tmp_path, capsys):
    out = tmp_path / "lengths.json"
    rc = cli_main(["stats", str(data.root / "data.json"), "--model", "internvl2-8b",
                   "--tokenizer", data.tok_dir, "--out", str(out), "--format", "jsonl",
                   "--workers", "1", "--max-tiles", "6", "--no-progress"])
    assert rc == 0
    _check(load_lengths(out), [_oracle(r, data.root, oracle_tok, max_tiles=6) for r in data.recs])
    assert f"{len(data.recs)} samples in 1 dataset(s), 0 skipped" in capsys.readouterr().err
    one_image = [r for r in data.recs if not isinstance(r.get("image"), list)]
    (tmp_path / "llava.json").write_text(json.dumps(one_image))
    rc = cli_main(["stats", str(tmp_path / "llava.json"), "--model", "llava-1.5-7b", "--tiling",
                   "anyres", "--template", "hf", "--image-root", str(data.root), "--tokenizer",
                   data.tok_dir, "--out", str(tmp_path / "next.npz"), "--workers", "2",
                   "--no-progress"])
    assert rc == 0
    _check(load_lengths(tmp_path / "next.npz"),
           [_oracle(r, data.root, oracle_tok, "llava_next") for r in one_image])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"id": "x", "image": "nope.png",
                                "conversations": [{"from": "human", "value": "a"}]}]))
    rc = cli_main(["stats", str(bad), "--model", "internvl2-8b", "--tokenizer", data.tok_dir,
                   "--out",
                   str(tmp_path / "bad_out.json"), "--workers", "1", "--no-progress"])
    assert rc == 1 and "sample 0 (id x): cannot read image" in capsys.readouterr().err
    assert not (tmp_path / "bad_out.json").exists()
