"""What `omnibal stats` accepts and refuses, against independent checks: ShareGPT / messages
records give the LLaVA records' lengths, unknown keys are errors, --verify-images catches a
truncated JPEG and a decompression bomb (a header-only read passes both), a tokenizer directory
with its own code loads only with --trust-remote-code, a Hugging Face checkpoint directory gives
its tiling and template, and the stored configuration and --png come out."""

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from megatron_omnibal.cli import main as cli_main
from megatron_omnibal.data.formats.records import read_sample
from megatron_omnibal.data.images.tiles import ImageDecodeError, decode_image
from megatron_omnibal.data.lengths import load_image_tiles, load_lengths, read_stats_config
from megatron_omnibal.data.sample.config import StatsConfig, config_from_dict
from megatron_omnibal.data.stats.compute import StatsError, compute_stats
from megatron_omnibal.data.text.conversations import INTERNVL_IMAGE, SampleError
from megatron_omnibal.data.text.tokenization import TokenCounter
from megatron_omnibal.models.data_side import model_data_side
from megatron_omnibal.models.presets import get_preset

WORDS = ["the", "a", "cat", "dog", "chart", "shows", "value", "of", "red", "blue", "what", "is",
         "in", "this", "picture", ",", ".", "?"]


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf_modules"))


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    rng = np.random.default_rng(0)
    tok.train_from_iterator([" ".join(rng.choice(WORDS, 30)) for _ in range(100)],
                            trainers.BpeTrainer(vocab_size=80, special_tokens=[
                                "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]))
    return tok


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    for k, (w, h) in enumerate([(40, 20), (20, 70), (33, 33)]):
        Image.fromarray(np.full((h, w, 3), 40 * k, np.uint8)).save(root / f"{k}.jpg")
    _tokenizer().save(str(root / "tok.json"))
    return root


def _run(root, records, tmp_path, *flags, name="data.json"):
    (tmp_path / name).write_text(json.dumps(records))
    out = tmp_path / f"{name}.npz"
    argv = ["stats", str(tmp_path / name), "--model", "tiny", "--tokenizer",
            str(root / "tok.json"), "--image-root", str(root), "--out", str(out),
            "--workers", "1", "--no-progress", *flags]
    return cli_main(argv), out


def test_sharegpt_and_messages_records_give_the_llava_records_lengths(root, tmp_path):
    llava = [
        {"id": "a", "image": "0.jpg", "conversations": [
            {"from": "human", "value": "<image>\nwhat is this"},
            {"from": "gpt", "value": "a cat"}]},
        {"id": "b", "image": ["0.jpg", "1.jpg"], "conversations": [
            {"from": "human", "value": "<image>\n<image>\nthe chart"},
            {"from": "gpt", "value": "red"}]},
        {"id": "c", "conversations": [{"from": "system", "value": "you help"},
                                      {"from": "human", "value": "what"},
                                      {"from": "gpt", "value": "blue"}]},
    ]
    sharegpt = [  # LLaMA-Factory sharegpt: images list without placeholders, top-level system
        {"conversations": [{"from": "human", "value": "what is this"},
                           {"from": "gpt", "value": "a cat"}], "images": ["0.jpg"]},
        {"conversations": [{"from": "human", "value": "the chart"},
                           {"from": "gpt", "value": "red"}], "images": ["0.jpg", "1.jpg"]},
        {"system": "you help", "conversations": [{"from": "human", "value": "what"},
                                                 {"from": "gpt", "value": "blue"}]},
    ]
    messages = [  # ms-swift / OpenAI style, string and part-list contents
        {"messages": [{"role": "user", "content": "<image>\nwhat is this"},
                      {"role": "assistant", "content": "a cat"}], "images": ["0.jpg"]},
        {"messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "\n"}, {"type": "image"},
            {"type": "text", "text": "\nthe chart"}]},
            {"role": "assistant", "content": "red"}], "images": ["0.jpg", "1.jpg"]},
        {"messages": [{"role": "system", "content": "you help"},
                      {"role": "user", "content": "what"},
                      {"role": "assistant", "content": "blue"}]},
    ]
    got = []
    for name, recs in (("llava", llava), ("sharegpt", sharegpt), ("messages", messages)):
        rc, out = _run(root, recs, tmp_path, name=f"{name}.json")
        assert rc == 0
        got.append(load_lengths(out))
    for other in got[1:]:
        assert other.tokens.tolist() == got[0].tokens.tolist()
        assert other.vit.tolist() == got[0].vit.tolist()
    assert got[0].image_flags[2] == 0 and got[0].vit[1] >= 2
    tiles = load_image_tiles(tmp_path / "messages.json.npz")
    assert list(tiles) == [1] and len(tiles[1]) == 2 and sum(tiles[1]) == got[2].image_flags[1]


@pytest.mark.parametrize("record, message", [
    ({"conversations": [{"from": "human", "value": "a"}], "imgs": ["0.jpg"]}, "unknown key 'imgs'"),
    ({"conversations": [{"from": "human", "value": "a"}], "audios": ["a.wav"]}, "audio samples"),
    ({"conversations": [{"from": "human", "value": "a"}], "videos": ["v.mp4"],
      "images": ["0.jpg"]}, "images and videos in one sample"),
    ({"conversations": [{"from": "human", "value": "<video> a"}], "videos": ["v.mp4", "w.mp4"]},
     r"2 video\(s\) but 1 '<video>'"),
    ({"conversations": [{"from": "human", "value": "a"}], "video": "v.mp4", "clip": [3, 2]},
     "'clip' must be"),
    ({"messages": [{"role": "user", "content": "a"}], "conversations": []}, "both"),
    ({"messages": [{"role": "bot", "content": "a"}]}, "unknown role 'bot'"),
    ({"image": "0.jpg", "images": ["0.jpg"], "conversations": []}, "both 'image' and 'images'"),
    ({"messages": [{"role": "user", "content": "<image> a <image>"}], "images": ["0.jpg"]},
     r"1 image\(s\) but 2"),
])
def test_records_the_reader_does_not_understand_are_errors(record, message):
    with pytest.raises(SampleError, match=message):
        read_sample(record)


def test_known_metadata_and_extra_keys_are_accepted():
    images, _, turns = read_sample({"id": 1, "width": 3, "height": 4, "image": "x.jpg",
                                    "conversations": [{"from": "human", "value": "q"},
                                                      {"from": "gpt", "value": "a"}]})
    assert images == ["x.jpg"] and turns[0] == ("human", "<image>\nq")
    with pytest.raises(SampleError, match="unknown key 'score'"):
        read_sample({"score": 1, "messages": [{"role": "user", "content": "q"}]})
    assert read_sample({"score": 1, "messages": [{"role": "user", "content": "q"}]},
                       extra_keys=("score",))[2] == [("human", "q")]


def _bomb_png(path, side=40_000):
    """A PNG whose header says side x side pixels (a decompression bomb) in a few bytes."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
                     + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_verify_images_catches_a_truncated_jpeg_that_the_header_read_passes(root, tmp_path):
    full = (root / "0.jpg").read_bytes()
    (tmp_path / "cut.jpg").write_bytes(full[: len(full) // 2])
    _bomb_png(tmp_path / "bomb.png")
    conv = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    recs = [{"id": "ok", "image": "0.jpg", "conversations": conv},
            {"id": "cut", "image": str(tmp_path / "cut.jpg"), "conversations": conv}]
    rc, out = _run(root, recs, tmp_path)
    assert rc == 0 and len(load_lengths(out)) == 2  # the header is intact
    config = StatsConfig(tokenizer=str(root / "tok.json"), verify_images=True)
    with pytest.raises(StatsError, match=r"data.json:\d+: sample 1 \(id cut\): cannot decode "
                                         r"image .*cut.jpg"):
        compute_stats(tmp_path / "data.json", config, image_root=root, workers=2,
                      progress=False)
    (tmp_path / "bomb.json").write_text(json.dumps(
        [{"id": "bomb", "image": str(tmp_path / "bomb.png"), "conversations": conv}]))
    with pytest.raises(StatsError, match=r"sample 0 \(id bomb\): decompression bomb .*bomb.png"):
        compute_stats(tmp_path / "bomb.json", StatsConfig(tokenizer=str(root / "tok.json")),
                      image_root=root, progress=False)
    result = compute_stats(tmp_path / "data.json", config, image_root=root, on_error="skip",
                           progress=False)
    assert [(s.index, s.id) for s in result.skipped] == [(1, "cut")]
    for path, message in ((tmp_path / "cut.jpg", "cannot decode image"),
                          (tmp_path / "bomb.png", "decompression bomb")):
        with pytest.raises(ImageDecodeError, match=message):  # what training decodes with
            decode_image(path)


CUSTOM_CODE = '''
from transformers import PreTrainedTokenizerFast


class ShoutingTokenizerFast(PreTrainedTokenizerFast):
    """A tokenizer class that exists only in this directory (like InternLM2's)."""
'''


def test_tokenizer_with_its_own_code_needs_trust_remote_code(root, tmp_path):
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "custom_tok"
    PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), eos_token="</s>").save_pretrained(path)
    (path / "tokenization_shouting.py").write_text(CUSTOM_CODE)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_shouting.ShoutingTokenizerFast"]}
    config["tokenizer_class"] = "ShoutingTokenizerFast"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"own code .*tokenization_shouting.ShoutingTokenizerFast"
                                         r".*pass --trust-remote-code"):
        TokenCounter(path, INTERNVL_IMAGE)
    counter = TokenCounter(path, INTERNVL_IMAGE, trust_remote_code=True)
    assert type(counter.hf).__name__ == "ShoutingTokenizerFast"
    plain = TokenCounter(root / "tok.json", INTERNVL_IMAGE)
    assert counter.count(["the cat is red"]) == plain.count(["the cat is red"])
    conv = [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]
    (tmp_path / "d.json").write_text(json.dumps([{"conversations": conv}]))
    base = ["stats", str(tmp_path / "d.json"), "--model", "tiny", "--tokenizer", str(path),
            "--out", str(tmp_path / "o.npz"), "--workers", "1", "--no-progress"]
    assert cli_main(base) == 2
    assert cli_main([*base, "--trust-remote-code"]) == 0
    stored = read_stats_config(tmp_path / "o.npz")
    assert stored["trust_remote_code"] is True


def _hf_dirs(tmp_path):
    """Tiny checkpoint directories as transformers and OpenGVLab write them (no weights)."""
    from transformers import CLIPImageProcessor, GotOcr2ImageProcessor, InternVLConfig, LlavaConfig

    out = {}
    d = tmp_path / "internvl_hf"
    InternVLConfig().save_pretrained(d)
    GotOcr2ImageProcessor(crop_to_patches=False, min_patches=2, max_patches=6,
                          size={"height": 448, "width": 448}).save_pretrained(d)
    out["internvl"] = d
    d = tmp_path / "internvl_chat"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "internvl_chat", "template": "internvl2_5", "max_dynamic_patch": 4,
        "min_dynamic_patch": 1, "use_thumbnail": False, "force_image_size": 448}))
    out["internvl_chat"] = d
    d = tmp_path / "internvl_chat_old"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "internvl_chat",
                                               "template": "internlm2-chat"}))
    out["internvl_chat_old"] = d
    d = tmp_path / "llava_hf"
    LlavaConfig().save_pretrained(d)
    CLIPImageProcessor(crop_size={"height": 336, "width": 336}).save_pretrained(d)
    out["llava"] = d
    return out


def test_hf_checkpoint_directories_give_their_tiling_and_template(tmp_path):
    dirs = _hf_dirs(tmp_path)
    internvl, llava = get_preset("internvl2-8b"), get_preset("llava-1.5-7b")
    side = model_data_side(internvl, dirs["internvl"])
    # InternVLProcessor crops to patches whatever the image processor's own flag says
    assert (side.tiling.mode, side.tiling.min_tiles, side.tiling.max_tiles,
            side.tiling.thumbnail, side.tiling.tokens_per_tile) == ("dynamic", 2, 6, True, 256)
    assert side.template == "internvl2_5" and side.image_style.context == "<IMG_CONTEXT>"
    side = model_data_side(internvl, dirs["internvl_chat"])
    assert (side.tiling.max_tiles, side.tiling.thumbnail) == (4, False)
    side = model_data_side(internvl, dirs["internvl_chat_old"])
    assert side.template is None and "internlm2-chat" in side.template_note
    side = model_data_side(llava, dirs["llava"])
    assert (side.tiling.mode, side.tiling.tile, side.tiling.tokens_per_tile) == ("fixed", 336, 576)
    assert side.template == "vicuna_v1" and side.image_style.context == "<image>"
    with pytest.raises(ValueError, match="tiled at 336 pixels.*takes 448"):
        model_data_side(internvl, dirs["llava"])


def test_stored_configuration_round_trips_and_png_is_written(root, tmp_path):
    conv = [{"from": "human", "value": "<image>\nq"}, {"from": "gpt", "value": "a"}]
    recs = [{"id": str(i), "image": f"{i % 3}.jpg", "conversations": conv} for i in range(9)]
    rc, out = _run(root, recs, tmp_path, "--png", str(tmp_path / "stats.png"), "--max-tiles", "3")
    assert rc == 0
    config, run = config_from_dict(read_stats_config(out), str(out))
    assert config.tiling.max_tiles == 3 and config.model.name == "tiny"
    assert config.tokenizer == str((root / "tok.json").resolve())
    assert run["tokenizer_fingerprint"] == TokenCounter(
        root / "tok.json", config.image_style).fingerprint()
    with Image.open(tmp_path / "stats.png") as img:
        assert img.size[0] > 500 and img.size[1] > 300
    assert Path(tmp_path / "stats.png").stat().st_size > 10_000


def test_stats_and_plan_take_the_model_from_an_hf_checkpoint(root, tmp_path):
    """`--model HF_DIR`: the length file stores the checkpoint's own tokens per tile and image
    token ids (read from its config.json and tokenizer files), and `omnibal plan` plans that
    very architecture."""

    from megatron_omnibal.models.hf_config import spec_from_hf
    from megatron_omnibal.planner.plan_file.plan import load_plan
    from tests.helpers import hf_models

    built = hf_models.internvl(tmp_path / "hf", six_b=True)
    spec = spec_from_hf(built.path)
    conv = [{"from": "human", "value": "<image>\nwhat is this"}, {"from": "gpt", "value": "a cat"}]
    recs = [{"id": str(i), "image": f"{i % 3}.jpg", "conversations": conv} for i in range(12)]
    (tmp_path / "d.json").write_text(json.dumps(recs))
    out = tmp_path / "lengths.npz"
    assert cli_main(["stats", str(tmp_path / "d.json"), "--model", str(built.path), "--tokenizer",
                     str(root / "tok.json"), "--image-root", str(root), "--out", str(out),
                     "--workers", "1", "--no-progress"]) == 0  # fmt: skip
    stored = read_stats_config(out)
    config, _ = config_from_dict(stored, str(out))
    m = config.model
    assert (m.image_size, m.tokens_per_tile, m.image_token_id, m.image_start_id, m.image_end_id,
            m.vocab_size) == (16, 4, 150, 151, 152, 160)  # the checkpoint's, not a preset's
    assert (spec.vit.image_size, spec.tokens_per_tile, spec.image_token_id) == (16, 4, 150)
    assert config.tiling.tokens_per_tile == 4
    lengths = load_lengths(out)
    text_only = lengths.tokens - lengths.image_flags * 4
    assert (lengths.image_flags > 0).all() and (text_only > 0).all()
    plan = tmp_path / "plan.json"
    assert cli_main(["plan", "--model", str(built.path), "--hardware", "A100-80G", "--gpus", "2",
                     "--global-batch", "8", "--lengths", str(out), "--out", str(plan)]) == 0
    assert load_plan(plan).model_spec == spec
