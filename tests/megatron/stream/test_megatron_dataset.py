"""Real-dataset samples for Megatron training, against `omnibal stats` and an independent rendering.

A small dataset is built on the fly (noise PNG/JPEG images of varied sizes, single- and
multi-image, text-only and multi-turn records, an InternVL meta file with repeat_time and
max_dynamic_patch) with a BPE tokenizer trained on the fly, and measured with the real
`omnibal stats` CLI. Every sample the source builds must have the length file's counts; its
tokens and labels must equal an oracle that spells the image tokens out and tokenizes the
template turn by turn (InternVL) or by prefixes (LLaVA); its tiles must equal an independent
grid search, resize and numpy slicing of the image.
"""

import json
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_omnibal.cli import main as cli_main
from megatron_omnibal.data.formats.generate import (
    image_array,
    save_image,
    train_tokenizer,
    write_json_list,
    write_jsonl,
    write_meta,
)
from megatron_omnibal.data.lengths import load_lengths, save_lengths
from megatron_omnibal.megatron.stream.dataset import DatasetError, open_source
from megatron_omnibal.megatron.stream.loader import SampleLoadError
from megatron_omnibal.megatron.stream.source import SourceSettings
from megatron_omnibal.models.presets import PRESETS
from megatron_omnibal.models.spec import ModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_local  # noqa: E402

SPEC = PRESETS["tiny"]  # 16-pixel tiles, 4 tokens per tile, vocab 128, image token 127
# The tiny model with LLaVA's MLP projector: 16-pixel tiles, (16/4)^2 = 16 tokens per tile.
LLAVA_SPEC = ModelSpec.from_dict({**SPEC.to_dict(), "name": "tiny-llava",
                                  "projector": {"type": "mlp", "downsample": 1.0,
                                                "hidden_size": 48},
                                  "tokens_per_tile": 0})
WORDS = ["the", "a", "cat", "dog", "chart", "shows", "value", "of", "red", "blue", "what", "is",
         "in", "this", "picture", "answer", "1", "2", "3", ",", ".", "?", "user", "assistant",
         "system", "USER", "ASSISTANT", ":", "you", "help"]
SIZES = [(16, 16), (40, 20), (20, 70), (100, 30), (33, 33), (8, 5), (64, 48), (17, 90)]
INTERNVL_FLAGS = "--model tiny --max-tiles 6 --system-prompt 'you help'"
MEAN = {"internvl": (0.485, 0.456, 0.406), "llava15": (0.48145466, 0.4578275, 0.40821073)}
STD = {"internvl": (0.229, 0.224, 0.225), "llava15": (0.26862954, 0.26130258, 0.27577711)}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


def _words(rng, lo, hi):
    return " ".join(rng.choice(WORDS[:21]) for _ in range(rng.randrange(lo, hi)))


def _records(rng, n, images, prefix):
    recs = []
    for i in range(n):
        kind = i % 6
        human = _words(rng, 2, 12)
        conv = [{"from": "human", "value": human}, {"from": "gpt", "value": _words(rng, 1, 15)}]
        rec = {"id": f"{prefix}{i}", "conversations": conv}
        if kind == 0:
            rec["image"] = rng.choice(images)
            conv[0]["value"] = "<image>\n" + human
        elif kind == 1:  # no placeholder: one goes in front of the first human turn
            rec["image"] = rng.choice(images)
        elif kind == 2:  # two images over two human turns
            rec["image"] = rng.sample(images, 2)
            conv[0]["value"] = "<image>\n" + human
            conv += [{"from": "human", "value": "and <image> ?"}, {"from": "gpt", "value": "no"}]
        elif kind == 3:  # text only, multi-turn
            conv += [{"from": "human", "value": _words(rng, 1, 5)},
                     {"from": "gpt", "value": _words(rng, 1, 5)}]
        elif kind == 4:  # own system turn
            rec["image"] = rng.choice(images)
            conv.insert(0, {"from": "system", "value": "you answer " + _words(rng, 1, 4)})
        recs.append(rec)
    return recs


def _tokenizer(rng, bos):
    corpus = [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]
    return train_tokenizer(corpus, vocab_size=90, bos=bos)


def _stats(dataset, tokenizer, flags, out):
    argv = ["stats", str(dataset), "--tokenizer", str(tokenizer), "--out", str(out),
            "--workers", "1", "--no-progress", *shlex.split(flags)]
    assert cli_main(argv) == 0
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dataset")
    rng = random.Random(3)
    nrng = np.random.default_rng(3)
    (root / "img").mkdir()
    images = []
    for k, (w, h) in enumerate(SIZES):
        name = f"img/{k}.{'png' if k % 2 else 'jpg'}"
        save_image(root / name, image_array(w, h, noise=256, rng=nrng))
        images.append(name)
    _tokenizer(random.Random(0), bos=False).save(str(root / "tok.json"))
    _tokenizer(random.Random(0), bos=True).save(str(root / "tok_bos.json"))
    recs = _records(rng, 18, images, "a")
    write_json_list(root / "data.json", recs, indent=1)
    # InternVL meta: a JSONL dataset repeated twice with 2 tiles at most, and a second one.
    for name, n in (("one", 7), ("two", 5)):
        write_jsonl(root / f"{name}.jsonl", _records(rng, n, images, name))
    write_meta(root / "meta.json", {
        "one": {"root": str(root), "annotation": "one.jsonl", "repeat_time": 2,
                "max_dynamic_patch": 2},
        "two": {"root": str(root), "annotation": "two.jsonl"}})
    spec_file = root / "tiny_llava.json"
    spec_file.write_text(json.dumps(LLAVA_SPEC.to_dict()))
    return SimpleNamespace(root=root, recs=recs, llava_flags=f"--model {spec_file}")


def _args(data_path, lengths, **kw):
    return SourceSettings(data=str(data_path), tokenizer=kw.get("tok"),
                          lengths_path=str(lengths), text_scale=kw.get("scale", 1))


# --- the oracle ------------------------------------------------------------------------------

def _oracle_grid(w, h, max_tiles, tile=16):
    """Nearest aspect ratio over all grids; ties to the biggest grid under 2x the image."""
    grids = sorted(((c, r) for c in range(1, 13) for r in range(1, 13) if c * r <= max_tiles),
                   key=lambda g: (g[0] * g[1], g[0]))
    best = min(abs(w / h - c / r) for c, r in grids)
    ties = [g for g in grids if abs(w / h - g[0] / g[1]) == best]
    fits = [g for g in ties if w * h > 0.5 * tile * tile * g[0] * g[1]]
    return fits[-1] if fits and fits[0] == ties[0] else ties[0]


def _oracle_pixels(path, model, max_tiles):
    img = Image.open(path).convert("RGB")
    if model == "llava15":
        side = max(img.size)
        arr = np.empty((side, side, 3), np.uint8)
        arr[:] = [int(m * 255) for m in MEAN[model]]
        x, y = (side - img.width) // 2, (side - img.height) // 2
        arr[y:y + img.height, x:x + img.width] = np.asarray(img)
        tiles = [np.asarray(Image.fromarray(arr).resize((16, 16), Image.BICUBIC))]
    else:
        c, r = _oracle_grid(img.width, img.height, max_tiles)
        big = np.asarray(img.resize((16 * c, 16 * r), Image.BICUBIC))
        tiles = [big[j * 16:(j + 1) * 16, i * 16:(i + 1) * 16] for j in range(r)
                 for i in range(c)]
        if c * r > 1:
            tiles.append(np.asarray(img.resize((16, 16), Image.BICUBIC)))
    x = np.stack(tiles).astype(np.float32) / 255
    return ((x - np.float32(MEAN[model])) / np.float32(STD[model])).transpose(0, 3, 1, 2)


def _oracle_turns(rec):
    turns = [(m["from"], m["value"]) for m in rec["conversations"]]
    images = rec.get("image") or []
    images = [images] if isinstance(images, str) else images
    if images and not any("<image>" in v for r, v in turns if r == "human"):
        k = next(i for i, (r, _) in enumerate(turns) if r == "human")
        turns[k] = ("human", "<image>\n" + turns[k][1])
    return turns, images


def _internvl_ids(turns, tok):
    """(ids, answer flags) of turns rendered with internvl2_5 ('you help' unless a system
    turn), tokenized turn by turn as InternVL's loader does."""
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    system = turns.pop(0)[1] if turns[0][0] == "system" else "you help"
    ids = enc(f"<|im_start|>system\n{system}<|im_end|>\n")
    target = [False] * len(ids)
    for role, value in turns:
        name = "user" if role == "human" else "assistant"
        piece = enc(f"<|im_start|>{name}\n{value}<|im_end|>\n")
        head = len(enc(f"<|im_start|>{name}\n")) if role == "gpt" else len(piece)
        ids += piece
        target += [False] * head + [True] * (len(piece) - head)
    return ids, target


def _oracle_sample(rec, root, tok, model, max_tiles, tpt=4):
    """(ids, labels, pixels) spelled out: every image token written in the text."""
    turns, images = _oracle_turns(rec)
    tiles = [_oracle_pixels(root / p, model, max(1, max_tiles // len(images))) for p in images]
    ctx = "<IMG_CONTEXT>" if model == "internvl" else "<image>"
    img_text = [("<img>" + ctx * (tpt * len(t)) + "</img>") if model == "internvl"
                else ctx * (tpt * len(t)) for t in tiles]
    k = 0
    for i, (role, value) in enumerate(turns):
        while "<image>" in value and role == "human" and k < len(img_text):
            value = value.replace("<image>", "\0", 1)
            k += 1
        turns[i] = (role, value)
    it = iter(img_text)
    turns = [(r, "".join(next(it) if ch == "\0" else ch for ch in v)) for r, v in turns]
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    if model == "internvl":
        ids, target = _internvl_ids(turns, tok)
    else:
        system = "A chat between a curious human and an artificial intelligence assistant. " \
                 "The assistant gives helpful, detailed, and polite answers to the human's " \
                 "questions."
        if turns[0][0] == "system":
            system = turns.pop(0)[1]
        text, spans = system + " ", []
        for role, value in turns:
            if role == "human":
                text += f"USER: {value} "
            else:
                text += "ASSISTANT: "
                spans.append((len(text), len(text) + len(value) + 4))
                text += value + "</s>"
        ids = [tok.token_to_id("<s>"), *enc(text)]
        target = [False] * len(ids)
        for a, b in spans:  # LLaVA's way: token counts of the text prefixes
            for j in range(len(enc(text[:a])), len(enc(text[:b]))):
                target[j + 1] = True
    ids = np.array([127 if t == tok.token_to_id(ctx) else t for t in ids])
    target = np.array(target)
    labels = np.full(len(ids), -100)
    labels[:-1] = np.where(target[1:], ids[1:], -100)
    pixels = np.concatenate(tiles) if tiles else np.zeros((1, 3, 16, 16), np.float32)
    return ids, labels, pixels, sum(len(t) for t in tiles)


def _fresh_tokenizer(path, model):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.add_special_tokens(["<img>", "<IMG_CONTEXT>", "</img>"] if model == "internvl"
                           else ["<image>"])
    return tok


def _check_all(source, lengths, oracle):
    assert len(source) == len(lengths)
    for i in range(len(source)):
        s = source(i)
        ids, labels, pixels, real = oracle(i)
        assert (len(s.images), len(s.tokens), int(s.image_flags.sum())) == (
            lengths.vit[i], lengths.tokens[i], lengths.image_flags[i]), i
        assert s.tokens.tolist() == ids.tolist(), i
        assert s.labels.tolist() == labels.tolist(), i
        assert int(s.image_flags.sum()) == real
        np.testing.assert_allclose(s.images.numpy(), pixels, atol=1e-5, err_msg=str(i))
        assert (s.labels != -100).any()  # every record has an answer


def test_internvl_json_list_samples_match_stats_and_oracle(data, tmp_path):
    lengths_path = _stats(data.root / "data.json", data.root / "tok.json", INTERNVL_FLAGS,
                          tmp_path / "lengths.json")
    lengths = load_lengths(lengths_path)
    source = open_source(_args(data.root / "data.json", lengths_path), lengths, SPEC)
    tok = _fresh_tokenizer(data.root / "tok.json", "internvl")
    _check_all(source, lengths, lambda i: _oracle_sample(
        data.recs[i], data.root, tok, "internvl", 6))
    assert lengths.vit.max() > 3 and (lengths.image_flags == 0).any()  # tiled and text-only


def test_meta_repeat_and_llava_fixed_tiles_with_bos(data, tmp_path):
    """InternVL meta (repeat_time 2, per-dataset max tiles) with LLaVA-1.5 tiling, the vicuna
    template and a BOS-adding tokenizer."""
    tok_path = data.root / "tok_bos.json"
    meta = _stats(data.root / "meta.json", tok_path, data.llava_flags, tmp_path / "meta_len.json")
    lengths = load_lengths(meta)
    source = open_source(_args(data.root / "meta.json", meta), lengths, LLAVA_SPEC)
    one = [json.loads(x) for x in (data.root / "one.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (data.root / "two.jsonl").read_text().splitlines()]
    recs = one + one + two
    tok = _fresh_tokenizer(tok_path, "llava15")
    _check_all(source, lengths, lambda i: _oracle_sample(recs[i], data.root, tok, "llava15", 1,
                                                         tpt=16))


def test_internvl_meta_max_dynamic_patch(data, tmp_path):
    meta = _stats(data.root / "meta.json", data.root / "tok.json", INTERNVL_FLAGS,
                  tmp_path / "m.json")
    lengths = load_lengths(meta)
    source = open_source(_args(data.root / "meta.json", meta), lengths, SPEC)
    one = [json.loads(x) for x in (data.root / "one.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (data.root / "two.jsonl").read_text().splitlines()]
    tok = _fresh_tokenizer(data.root / "tok.json", "internvl")
    cases = [(r, 2) for r in one + one] + [(r, 6) for r in two]
    _check_all(source, lengths, lambda i: _oracle_sample(cases[i][0], data.root, tok,
                                                         "internvl", cases[i][1]))
    assert lengths.vit[:14].max() <= 3  # max_dynamic_patch 2: 2 tiles + thumbnail


def test_length_file_of_other_data_or_model_is_refused_naming_the_sample(data, tmp_path):
    lengths_path = _stats(data.root / "data.json", data.root / "tok.json", INTERNVL_FLAGS,
                          tmp_path / "lengths.npz")
    good = load_lengths(lengths_path)
    args = _args(data.root / "data.json", lengths_path)
    tokens = good.tokens.copy()
    tokens[0] += 1
    changed = good.subset(np.arange(len(good)))
    changed.tokens[:] = tokens
    with pytest.raises(DatasetError, match=rf"id a0.*token_num={tokens[0]}.*token_num="
                                           rf"{good.tokens[0]}"):
        open_source(args, changed, SPEC)
    with pytest.raises(DatasetError, match=f"has {len(good) - 1} samples.*gives {len(good)}"):
        open_source(args, good.subset(np.arange(len(good) - 1)), SPEC)
    # a record the spread check does not visit is caught when the sample is built
    late = good.subset(np.arange(len(good)))
    late.vit[5] += 1
    source = open_source(args, late, SPEC, check=1)
    with pytest.raises(DatasetError, match=r"id a5.*vit_num"):
        source(5)
    # counted for another model (LLaVA-style tiles of 16 tokens): refused up front
    other = _stats(data.root / "data.json", data.root / "tok.json", data.llava_flags,
                   tmp_path / "llava.npz")
    with pytest.raises(DatasetError, match="counted for another model than tiny: 16 tokens per "
                                           "tile, the model's are 4"):
        open_source(_args(data.root / "data.json", other), load_lengths(other), SPEC)
    # another tokenizer than the one counted with
    with pytest.raises(DatasetError, match="is not the one .* was counted with"):
        open_source(_args(data.root / "data.json", lengths_path, tok=data.root / "tok_bos.json"),
                    good, SPEC)
    # a plain length file says nothing about how it was counted
    save_lengths(good, tmp_path / "plain.json")
    with pytest.raises(DatasetError, match="holds no stats configuration"):
        open_source(_args(data.root / "data.json", tmp_path / "plain.json"), good, SPEC)
    with pytest.raises(DatasetError, match="--omnibal-text-scale 2"):
        open_source(_args(data.root / "data.json", lengths_path, scale=2), good, SPEC)


def test_ranks_without_pixels_never_open_an_image(data, tmp_path):
    """Tokens and labels from the text and the length file only: with the images gone, a
    later-stage source builds the same tokens, labels and tile counts as the first stage's."""
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(data.root / "img", root / "img")
    (root / "data.json").write_text((data.root / "data.json").read_text())
    lengths_path = _stats(root / "data.json", data.root / "tok.json", INTERNVL_FLAGS,
                          tmp_path / "lengths.npz")
    lengths = load_lengths(lengths_path)
    first = open_source(_args(root / "data.json", lengths_path), lengths, SPEC)
    want = [first(i) for i in range(len(lengths))]
    shutil.rmtree(root / "img")
    later = open_source(_args(root / "data.json", lengths_path), lengths, SPEC, pixels=False)
    for i, w in enumerate(want):
        s = later(i)
        assert torch.equal(s.tokens, w.tokens) and torch.equal(s.labels, w.labels), i
        assert s.images.shape == w.images.shape and torch.equal(s.image_flags, w.image_flags)
    assert any(len(r.get("image") or []) == 2 for r in data.recs)  # per-image tiles are used
    with pytest.raises(SampleLoadError, match=r"id a0.*cannot read image"):
        first(0)


# --- through the entry point (torchrun, gloo) --------------------------------------------------

ROOT = Path(__file__).resolve().parents[3]
WORKERS = ROOT / "tests" / "helpers" / "megatron_workers"


def _entry_flags(data_path, lengths_path, lengths, steps):
    return ["--omnibal", "--omnibal-model", "tiny", "--omnibal-lengths", str(lengths_path),
            "--omnibal-data", str(data_path),
            "--omnibal-vit-budget", str(2 * int(lengths.vit.max())),
            "--omnibal-token-budget", str(2 * int(lengths.tokens.max())),
            "--pipeline-model-parallel-size", "2", "--omnibal-vit-pp-layers", "4,0",
            "--omnibal-llm-pp-layers", "1,3", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--train-iters", str(steps), "--lr", "1e-3",
            "--transformer-impl", "local", "--seed", "5", "--log-interval", "1",
            "--num-workers", "2"]


@pytest.mark.megatron
def test_pretrain_vlm_trains_on_the_dataset_skips_or_stops_at_a_bad_image(data, tmp_path):
    """PP=2 through torchrun, 2 DataLoader workers per rank, one epoch. A truncated JPEG
    passes `omnibal stats` (its header is intact). With --omnibal-bad-sample skip both stages
    leave that sample out and read the same micro-batches, the last stage counts exactly the
    oracle's answer tokens of the other samples, the report names it, and only the first stage
    opens image files; by default the run stops naming it. Length files of other data or
    without a stored configuration stop the entry point before any process group."""
    import shutil

    from megatron_omnibal.balance.config import BalanceConfig
    from megatron_omnibal.balance.sampler import BalancedBatchSampler
    from megatron_omnibal.data.lengths import load_image_tiles, read_stats_config

    root = tmp_path / "copy"
    shutil.copytree(data.root / "img", root / "img")
    full = (root / "img" / "0.jpg").read_bytes()
    (root / "img" / "cut.jpg").write_bytes(full[: len(full) // 2])
    recs = [dict(r) for r in data.recs]
    recs[0]["image"] = "img/cut.jpg"
    (root / "data.json").write_text(json.dumps(recs))
    lengths_path = _stats(root / "data.json", data.root / "tok.json", INTERNVL_FLAGS,
                          tmp_path / "lengths.npz")
    lengths = load_lengths(lengths_path)
    config = BalanceConfig(dp_size=1, micro_batches=2, vit_budget=2 * int(lengths.vit.max()),
                           token_budget=2 * int(lengths.tokens.max()), seed=5)
    steps = BalancedBatchSampler(lengths, config, dp_rank=0).steps_per_epoch
    flags = _entry_flags(root / "data.json", lengths_path, lengths, steps)
    bad = lengths.subset(np.arange(len(lengths)))
    bad.tokens[len(bad) - 1] += 3
    save_lengths(bad, tmp_path / "bad.npz", config=read_stats_config(lengths_path),
                 image_tiles=load_image_tiles(lengths_path))
    save_lengths(lengths, tmp_path / "plain.json")
    cases = [[str(tmp_path / name) if f == str(lengths_path) else f for f in flags]
             for name in ("bad.npz", "plain.json")]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, str(WORKERS / "train_validate.py"), str(tmp_path / "cases.json"),
         str(tmp_path / "refused.json")],
        env={**env, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, capture_output=True,
        text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    refused = json.loads((tmp_path / "refused.json").read_text())
    assert [r["status"] for r in refused] == [2, 2]
    assert not any(r["process_group"] for r in refused)
    last = len(bad) - 1
    assert f"id a{last}" in refused[0]["error"][0]
    assert f"token_num={bad.tokens[last]}" in refused[0]["error"][0]
    assert "holds no stats configuration" in refused[1]["error"][0]

    report = tmp_path / "bad_samples.jsonl"
    proc = run_local(2, [WORKERS / "train_record.py", tmp_path / "run", *flags,
                         "--omnibal-bad-sample", "skip", "--omnibal-bad-sample-report", report],
                     240, {**env, "OMNIBAL_WATCH_DIR": str(root / "img")})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = {}
    for p in (tmp_path / "run").glob("rank*.json"):
        doc = json.loads(p.read_text())
        opened = tmp_path / "run" / f"opened_rank{doc['rank']}.txt"
        doc["opened"] = opened.read_text().split() if opened.exists() else []
        ranks[doc["pp_rank"]] = doc
    first, second = ranks[0]["micro"], ranks[1]["micro"]
    assert len(first) == len(second) == 2 * steps
    assert [m["indices"] for m in first] == [m["indices"] for m in second]
    assert sorted(i for m in first for i in m["indices"]) == list(range(len(lengths)))
    assert ranks[0]["opened"] and not ranks[1]["opened"]  # pixels on the first stage only
    assert str(root / "img" / "cut.jpg") in ranks[0]["opened"]
    tok = _fresh_tokenizer(data.root / "tok.json", "internvl")
    for micro in second:
        expected = sum(int((_oracle_sample(recs[i], root, tok, "internvl", 6)[1]
                            != -100).sum()) for i in micro["indices"] if i != 0)
        assert micro["tokens"] == expected
        assert np.isfinite(micro["loss"]) and micro["loss"] > 0
    skipped = [json.loads(x) for x in report.read_text().splitlines()]
    assert [(e["index"], "id a0" in e["sample"]) for e in skipped] == [(0, True)]
    assert "cannot decode image" in skipped[0]["reason"]
    assert "1 sample(s) could not be loaded and were skipped" in proc.stderr

    proc = run_local(2, [WORKERS / "train_record.py", tmp_path / "stop", *flags], 240, env)
    assert proc.returncode != 0
    stops = [x for x in proc.stderr.splitlines() if x.startswith("pretrain_vlm: error:")]
    assert stops and "sample 0 (id a0)" in stops[0] and "cannot decode image" in stops[0]


def test_samples_skipped_by_stats_are_left_out_in_order(data, tmp_path):
    """`omnibal stats --on-error skip` leaves bad records out of the length file; the source
    reads its skipped report and maps every length record to the right annotation record."""
    recs = list(data.recs)
    recs[3] = {**recs[3], "image": "img/missing.png"}
    recs[10] = {"id": "bad", "conversations": [{"from": "gpt", "value": "no question"}]}
    (data.root / "skips.json").write_text(json.dumps(recs))
    out = tmp_path / "skips_len.json"
    argv = ["stats", str(data.root / "skips.json"), "--tokenizer", str(data.root / "tok.json"),
            "--out", str(out), "--workers", "1", "--no-progress", "--on-error", "skip",
            *shlex.split(INTERNVL_FLAGS)]
    assert cli_main(argv) == 0
    lengths = load_lengths(out)
    assert len(lengths) == len(recs) - 2
    source = open_source(_args(data.root / "skips.json", out), lengths, SPEC)
    kept = [r for k, r in enumerate(recs) if k not in (3, 10)]
    tok = _fresh_tokenizer(data.root / "tok.json", "internvl")
    _check_all(source, lengths, lambda i: _oracle_sample(kept[i], data.root, tok, "internvl", 6))
    out.with_name(f"{out.stem}.skipped.json").unlink()
    with pytest.raises(DatasetError, match=f"has {len(recs) - 2} samples.*gives {len(recs)}"):
        open_source(_args(data.root / "skips.json", out), lengths, SPEC)


@pytest.mark.megatron
def test_start_up_work_happens_once(data, tmp_path):
    """PP=2 through torchrun on the real dataset, counted by wrapping the functions on every
    rank (startup_counts.py): the node balances the epoch plan and reads the length file once
    (its local rank 0; the other rank maps its files), the data source's record index is built
    once (the same), and each rank opens the data source and validates the layout once."""
    lengths_path = _stats(data.root / "data.json", data.root / "tok.json", INTERNVL_FLAGS,
                          tmp_path / "lengths.npz")
    lengths = load_lengths(lengths_path)
    flags = _entry_flags(data.root / "data.json", lengths_path, lengths, 1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
           "OMNIBAL_CACHE_DIR": str(tmp_path / "cache")}
    proc = run_local(2, [WORKERS / "startup_counts.py", tmp_path / "counts", *flags], 300, env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    counts = [json.loads((tmp_path / "counts" / f"counts_rank{r}.json").read_text())
              for r in (0, 1)]  # fmt: skip
    assert [(c["epoch_plans_balanced"], c["length_file_reads"], c["record_indexes_built"])
            for c in counts] == [(1, 1, 1), (0, 0, 0)]
    for c in counts:
        assert (c["data_sources_opened"], c["layout_validations"], c["plan_json_reads"]) == (
            1, 1, 0), c  # fmt: skip
