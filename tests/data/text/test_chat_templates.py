"""The checkpoint's own chat template (`hf`): a sample's tokens and loss mask against
transformers, for templates of the forms released checkpoints carry
(tests/helpers/chat_templates.py).

Oracles: transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` on the
template with generation markers (the released one where it has them, llava-hf's; otherwise the
same text with markers around each answer and its end of turn), and for llava-hf its processor,
which also adds the BOS and repeats `<image>` per image token. Both of our paths are checked:
turn by turn (a template without markers) and by markers. `omnibal stats` counts exactly the
tokens training encodes; templates that cannot train are refused, naming the record.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.data.sample.config import StatsConfig
from megatron_omnibal.data.sample.text import SampleText
from megatron_omnibal.data.stats.compute import StatsError, compute_stats
from megatron_omnibal.data.text import conversations as conv
from megatron_omnibal.data.text.tokenization import TokenCounter
from tests.helpers import chat_templates as ct

IMAGE_TOKENS = 16  # llava-hf's processor below: 16-pixel images, 4-pixel patches, CLS dropped

ONE_IMAGE = [("human", "<image>\nwhat is in this picture ?"), ("gpt", "a cat .")]
TWO_IMAGES = [("system", "answer in words ."),
              ("human", "<image>\n<image>\nwhich value is larger ?"), ("gpt", "2 ."),
              ("human", "what year ?"), ("gpt", " 1 2 3 ")]
TEXT = [("human", "what is this ?"), ("gpt", "a chart"), ("human", "the value ?"),
        ("gpt", "3"), ("human", "and the year ?"), ("gpt", "2 , 1")]
CONVERSATIONS = [(ONE_IMAGE, 1), (TWO_IMAGES, 2), (TEXT, 0)]
FAMILIES = {
    "qwen2_5_vl": (ct.QWEN2_5_VL, ct.QWEN2_5_VL_MARKED, ct.QWEN_SPECIALS, conv.QWEN_VL_IMAGE,
                   {"eos": "<|im_end|>"}),
    "llama3": (ct.LLAMA3, ct.LLAMA3_MARKED, ct.LLAMA3_SPECIALS, conv.LLAVA_IMAGE,
               {"bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "bos_processor": True}),
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Per family: (plain template dir, marked template dir, image style)."""
    root = tmp_path_factory.mktemp("chat_templates")
    out = {}
    for name, (plain, marked, specials, style, kw) in FAMILIES.items():
        out[name] = (ct.byte_level_tokenizer(root / name, plain, specials, **kw),
                     ct.byte_level_tokenizer(root / f"{name}_marked", marked, specials, **kw),
                     style)
    llava = {"bos": "<s>", "eos": "</s>", "bos_processor": True}
    out["llava_hf"] = (ct.byte_level_tokenizer(root / "llava", ct.LLAVA_HF_UNMARKED,
                                               ct.LLAVA_SPECIALS, **llava),
                       ct.byte_level_tokenizer(root / "llava_marked", ct.LLAVA_HF,
                                               ct.LLAVA_SPECIALS, **llava), conv.LLAVA_IMAGE)
    return out


def _ours(path: Path, style: conv.ImageStyle, turns, images: int, system: str | None = None):
    """(ids, loss flags) as training builds them, and the tokens stats counts."""
    counter = TokenCounter(path, style)
    text = SampleText(StatsConfig(tokenizer=str(path), template="hf", image_style=style,
                                  system=system), counter)
    chat = text.render(turns, [conv.Media.image(style)] * images)
    ids, flags = counter.encode_chat(chat)
    counted = sum(counter.count(chat.pieces)) + (counter.specials if chat.specials else 0)
    return ids, flags, counted, text


def _inline_messages(turns, style: conv.ImageStyle) -> list[dict]:
    """The conversation as string contents, each image spelled as the model writes it."""
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": role[r], "content": t.replace("<image>", style.compact())} for r, t in turns]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("marked", [False, True], ids=["turn_by_turn", "markers"])
def test_string_templates_match_transformers_tokens_and_assistant_mask(tokenizers, family,
                                                                       marked):
    from transformers import AutoTokenizer

    plain, with_markers, style = tokenizers[family]
    oracle = AutoTokenizer.from_pretrained(str(with_markers))
    for turns, images in CONVERSATIONS:
        ids, flags, counted, text = _ours(with_markers if marked else plain, style, turns, images)
        assert text.hf.markers is marked and not text.hf.parts
        messages = _inline_messages(turns, style)
        want = oracle.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        assert ids.tolist() == want["input_ids"]
        assert flags.astype(int).tolist() == want["assistant_masks"]
        assert counted == len(ids)
        answers = [t for r, t in turns if r == "gpt"]
        trained = oracle.decode(ids[flags].tolist())
        assert all(a.strip() in trained for a in answers) and "user" not in trained
    # Qwen2.5-VL's default system prompt, written by its template; Llama-3's BOS only once
    first, *_ = _ours(plain, style, ONE_IMAGE, 1)
    decoded = oracle.decode(first.tolist())
    if family == "qwen2_5_vl":
        assert decoded.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")
        assert decoded.count("<|vision_start|><|image_pad|><|vision_end|>") == 1
    else:
        assert first.tolist().count(oracle.convert_tokens_to_ids("<|begin_of_text|>")) == 1


@pytest.mark.parametrize("marked", [True, False], ids=["released_markers", "turn_by_turn"])
def test_llava_hf_parts_template_matches_its_processor(tokenizers, marked):
    """llava-hf renders typed parts only: images go to it as {'type': 'image'} parts; its
    processor adds the BOS and repeats <image> per image token: the oracle of ids and mask."""
    from PIL import Image
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    plain, released, style = tokenizers["llava_hf"]
    tok = AutoTokenizer.from_pretrained(str(released))
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 16},
                                           crop_size={"height": 16, "width": 16}),
        tokenizer=tok, patch_size=4, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, image_token="<image>", chat_template=ct.LLAVA_HF)
    image = Image.fromarray(np.full((20, 30, 3), 128, np.uint8))
    role = {"human": "user", "gpt": "assistant", "system": "system"}
    for turns, images in CONVERSATIONS:
        ids, flags, counted, text = _ours(released if marked else plain, style, turns, images)
        assert text.hf.parts and text.hf.markers is marked
        messages = []
        for r, t in turns:  # the processor's user writes images as parts, text around them
            parts = [{"type": "image", "image": image}] * t.count("<image>")
            words = t.replace("<image>\n", "")
            messages.append({"role": role[r], "content": [*parts, {"type": "text",
                                                                   "text": words}]})
        want = processor.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
            chat_template=ct.LLAVA_HF if marked else ct.LLAVA_HF_SPACE_MARKED)
        counts = np.where(ids == tok.convert_tokens_to_ids("<image>"), IMAGE_TOKENS, 1)
        assert np.repeat(ids, counts).tolist() == want["input_ids"][0]
        assert np.repeat(flags, counts).astype(int).tolist() == want["assistant_masks"][0]
        assert counted == len(ids) and ids[0] == tok.bos_token_id


def test_a_template_kept_for_the_processor_only_is_used(tokenizers, tmp_path):
    """Some llava-hf releases keep their template in chat_template.json, which AutoTokenizer
    does not load (their processor does): rendered with it all the same."""
    plain, marked, style = tokenizers["llava_hf"]
    path = tmp_path / "tok"
    shutil.copytree(marked, path)
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": ct.LLAVA_HF}))
    assert _ours(path, style, ONE_IMAGE, 1)[0].tolist() == _ours(marked, style, ONE_IMAGE,
                                                                 1)[0].tolist()


def test_a_system_prompt_the_template_drops_is_refused(tmp_path):
    no_system = ("{% for m in messages %}{% if m['role'] != 'system' %}<|im_start|>{{ m['role'] }}"
                 "\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = ct.byte_level_tokenizer(tmp_path / "tok", no_system, ct.QWEN_SPECIALS)
    with pytest.raises(ValueError, match="drops the system message"):
        _ours(path, conv.QWEN_VL_IMAGE, TEXT, 0, system="Be brief.")
    *_, text = _ours(path, conv.QWEN_VL_IMAGE, TEXT, 0)  # no system prompt: it trains
    with pytest.raises(conv.SampleError, match="drops the system message"):
        text.render(TWO_IMAGES, [conv.Media.image(conv.QWEN_VL_IMAGE)] * 2)


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}"
     "<|im_end|>\n{% endif %}{% endfor %}", "renders nothing for it"),
    ("{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'user' %}{{ m['content'] }}"
     "{% else %}(an answer){% endif %} {% endfor %}"
     "{% if add_generation_prompt %}assistant: {% endif %}", "does not write it"),
    ("{{ messages | length }}", "renders neither"),
    (None, "needs a tokenizer directory with a chat template"),
])
def test_templates_that_cannot_train_are_refused_up_front(tmp_path, template, words):
    from transformers import PreTrainedTokenizerFast

    path = ct.byte_level_tokenizer(tmp_path / "tok", template or "", ct.QWEN_SPECIALS)
    if template is None:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
        tok.chat_template = None
        tok.save_pretrained(str(path))
        (path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match=words):
        _ours(path, conv.QWEN_VL_IMAGE, TEXT, 0)


def test_stats_refuses_a_record_whose_answer_is_not_prefix_stable(tmp_path):
    """A template that rewrites earlier answers (as reasoning templates drop old thoughts):
    one round trains, the two-round record is refused by name."""
    rewrites = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{% if m['role'] == 'assistant' and not loop.last %}(earlier answer)"
                "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = ct.byte_level_tokenizer(tmp_path / "tok", rewrites, ct.QWEN_SPECIALS)
    recs = [{"id": "one", "conversations": [{"from": "human", "value": "what ?"},
                                            {"from": "gpt", "value": "a cat"}]},
            {"id": "two", "conversations": [{"from": f, "value": v} for f, v in zip(
                ["human", "gpt", "human", "gpt"], ["what ?", "a cat", "year ?", "1"],
                strict=True)]}]
    (tmp_path / "data.json").write_text(json.dumps(recs))
    config = StatsConfig(tokenizer=str(path), template="hf", image_style=conv.QWEN_VL_IMAGE)
    with pytest.raises(StatsError, match=r"data.json.*sample 1 \(id two\).*answer 1.*"
                                         r"not prefix-stable"):
        compute_stats(tmp_path / "data.json", config, progress=False)
    result = compute_stats(tmp_path / "data.json", config, on_error="skip", progress=False)
    assert result.records == [2] and [s.index for s in result.skipped] == [1]
