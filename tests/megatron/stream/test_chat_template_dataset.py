"""Training samples of checkpoints that carry their own chat template (llava-hf's and
Qwen2.5-VL-Instruct's forms) against transformers, and the template's checks shared by
`omnibal stats` and training.

Tiny checkpoints with the generated dataset's tokenizer and a template of the released form
(tests/helpers/chat_templates.py), measured by the real `omnibal stats` CLI (which picks `hf`).
Oracles: LlavaProcessor.apply_chat_template on each record (BOS added, `<image>` repeated per image
token, the assistant mask from the template's generation markers); for Qwen2.5-VL the
tokenizer's apply_chat_template of the record with each image spelled out as its processor
does (`<|vision_start|>` + `<|image_pad|>` x merge groups of Qwen2VLImageProcessor's grid +
`<|vision_end|>`), its mask from the same template with markers around each answer and its
`<|im_end|>\n`. Every sample's tokens must equal the oracle's ids and its labels the next token
where the mask is set.
"""

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from megatron_omnibal.cli import main as cli_main
from megatron_omnibal.data.formats.generate import SYSTEM_PROMPT, qa_dataset
from megatron_omnibal.data.lengths import load_lengths
from megatron_omnibal.megatron.stream.dataset import DatasetError, open_source
from megatron_omnibal.megatron.stream.source import SourceSettings
from megatron_omnibal.models.resolve import resolve_model
from tests.helpers import chat_templates as ct
from tests.helpers import hf_models

IGNORE = -100
QWEN_PRE = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 9, "patch_size": 14,
            "merge_size": 2, "temporal_patch_size": 2}


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNIBAL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava_hf")
    made = qa_dataset(root / "data", samples=16, images=5, seed=4)
    ckpt = hf_models.llava(root / "ckpt", llm_layers=1).path
    ct.model_tokenizer(ckpt, made.tokenizer, ct.LLAVA_HF, {"<image>": hf_models.LLAVA_IMAGE},
                       bos="<s>", eos="</s>", bos_processor=True)
    lengths = root / "lengths.npz"
    assert cli_main(["stats", str(made.meta), "--model", str(ckpt), "--out", str(lengths),
                     "--system-prompt", SYSTEM_PROMPT, "--workers", "1",
                     "--no-progress"]) == 0  # fmt: skip
    return made, ckpt, lengths, _records(root)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_hf")
    made = qa_dataset(root / "data", samples=12, images=4, seed=5)
    ckpt = hf_models.qwen2_5_vl(root / "ckpt", llm_layers=1).path
    (ckpt / "preprocessor_config.json").write_text(json.dumps(QWEN_PRE))
    ids = {"<|image_pad|>": hf_models.QWEN_IMAGE, "<|video_pad|>": hf_models.QWEN_VIDEO,
           "<|vision_start|>": hf_models.QWEN_START, "<|vision_end|>": hf_models.QWEN_END}
    ct.model_tokenizer(ckpt, made.tokenizer, ct.QWEN2_5_VL, ids, eos="<|im_end|>")
    lengths = root / "lengths.npz"
    assert cli_main(["stats", str(made.meta), "--model", str(ckpt), "--out", str(lengths),
                     "--workers", "1", "--no-progress"]) == 0
    return made, ckpt, lengths, _records(root)


def _records(root):
    return [json.loads(line) for name in ("pictures", "numbers")
            for line in (root / "data" / f"{name}.jsonl").read_text().splitlines()]


def _source(made, ckpt, lengths, tokenizer=None):
    settings = SourceSettings(data=str(made.meta), lengths_path=str(lengths),
                              tokenizer=None if tokenizer is None else str(tokenizer))
    return open_source(settings, load_lengths(lengths), resolve_model(str(ckpt)), pixels=False)


def test_samples_equal_the_llava_processor_with_its_chat_template(data):
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    made, ckpt, lengths, records = data
    source = _source(made, ckpt, lengths)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(size={"shortest_edge": 16},
                                           crop_size={"height": 16, "width": 16}),
        tokenizer=AutoTokenizer.from_pretrained(str(ckpt)), patch_size=4,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
        image_token="<image>", chat_template=ct.LLAVA_HF)
    assert len(source) == len(records)
    role = {"human": "user", "gpt": "assistant"}
    for index, record in enumerate(records):
        names = record.get("image") or []
        images = [Image.open(made.meta.parent / "images" / n)
                  for n in ([names] if isinstance(names, str) else names)]
        messages = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
        for turn in record["conversations"]:
            k = turn["value"].count("<image>")
            parts = [{"type": "image", "image": images.pop(0)} for _ in range(k)]
            messages.append({"role": role[turn["from"]], "content": [
                *parts, {"type": "text", "text": turn["value"].replace("<image>\n", "")}]})
        want = processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
        ids, mask = np.asarray(want["input_ids"][0]), np.asarray(want["assistant_masks"][0])
        sample = source(index)
        assert sample.tokens.tolist() == ids.tolist(), record["id"]
        labels = np.where(mask[1:] == 1, ids[1:], IGNORE).tolist() + [IGNORE]
        assert sample.labels.tolist() == labels, record["id"]
        assert (sample.labels != IGNORE).any()


def test_qwen_samples_equal_its_chat_template_with_the_processors_image_pads(qwen):
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    made, ckpt, lengths, records = qwen
    source = _source(made, ckpt, lengths)
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    processor = Qwen2VLImageProcessorPil(**QWEN_PRE)
    role = {"human": "user", "gpt": "assistant"}
    assert len(source) == len(records)
    for index, record in enumerate(records):
        names = record.get("image") or []
        pads = [int(processor(Image.open(made.meta.parent / "images" / n).convert("RGB"))[
            "image_grid_thw"].prod()) // 4 for n in ([names] if isinstance(names, str) else names)]
        messages = []
        for turn in record["conversations"]:
            text = turn["value"]
            while "<image>" in text:
                text = text.replace("<image>", "<|vision_start|>" + "<|image_pad|>" * pads.pop(0)
                                    + "<|vision_end|>", 1)
            messages.append({"role": role[turn["from"]], "content": text})
        want = tok.apply_chat_template(messages, chat_template=ct.QWEN2_5_VL_MARKED,
                                       tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
        ids, mask = np.asarray(want["input_ids"]), np.asarray(want["assistant_masks"])
        sample = source(index)
        assert sample.tokens.tolist() == ids.tolist(), record["id"]
        labels = np.where(mask[1:] == 1, ids[1:], IGNORE).tolist() + [IGNORE]
        assert sample.labels.tolist() == labels, record["id"]
        assert (sample.labels != IGNORE).any()
        rendered = tok.apply_chat_template(messages, tokenize=False)  # its default system
        assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")


def test_another_or_no_chat_template_is_refused_as_stats_refuses_it(data, tmp_path, capsys):
    made, ckpt, lengths, _ = data
    other = tmp_path / "other"
    ct.model_tokenizer(other, made.tokenizer, ct.LLAVA_HF_UNMARKED,
                       {"<image>": hf_models.LLAVA_IMAGE}, bos="<s>", eos="</s>",
                       bos_processor=True)
    with pytest.raises(DatasetError, match="has another chat template"):
        _source(made, ckpt, lengths, other)
    none = tmp_path / "none"
    shutil.copytree(other, none)
    (none / "chat_template.jinja").unlink()
    config = json.loads((none / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (none / "tokenizer_config.json").write_text(json.dumps(config))
    words = "the 'hf' template needs a tokenizer directory with a chat template"
    assert cli_main(["stats", str(made.meta), "--model", str(ckpt), "--tokenizer", str(none),
                     "--out", str(tmp_path / "l.npz"), "--no-progress"]) != 0
    assert words in capsys.readouterr().err
    with pytest.raises(DatasetError, match=words):
        _source(made, ckpt, lengths, none)
