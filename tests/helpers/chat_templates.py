"""Chat templates of the forms released checkpoints carry, and tiny tokenizers that hold them.

Written here (nothing downloaded), each in the form of its release:
- QWEN2_5_VL: Qwen2.5-VL-Instruct's ChatML: the default system prompt "You are a helpful
  assistant." when the first message is not a system one, string or typed-part contents, images
  and videos as `<|vision_start|><|image_pad|><|vision_end|>` (`<|video_pad|>`), no
  {% generation %} markers;
- QWEN3_VL: Qwen3-VL-Instruct's ChatML for plain conversations: the same parts, no default
  system prompt (a system message only where the conversation has one);
- LLAVA_HF: llava-hf's `USER: ` / `ASSISTANT: ` over typed parts only (images first, `<image>\\n`
  each; a string content renders nothing), answers inside {% generation %} markers, `ASSISTANT:`
  as the generation prompt;
- LLAMA3: Llama-3's header template (`<|begin_of_text|>` from bos_token, `<|start_header_id|>`
  role `<|end_header_id|>\\n\\n` trimmed content `<|eot_id|>`), string contents only.
`*_MARKED` / `LLAVA_HF_UNMARKED`: the same text with (without) generation markers around what
the loss should cover (the answer and its end of turn), so transformers' assistant mask of the
marked form is the oracle of a turn-by-turn mask of the unmarked one (for llava-hf:
`LLAVA_HF_SPACE_MARKED`, whose markers also hold the space its generation prompt leaves out).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from megatron_omnibal.data.formats.generate import train_tokenizer


def _qwen(marked: bool, default_system: bool = True) -> str:
    body = ("{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
            "{% else %}{% for content in message['content'] %}"
            "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
            "{% set image_count.value = image_count.value + 1 %}"
            "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
            "<|vision_start|><|image_pad|><|vision_end|>"
            "{% elif content['type'] == 'video' or 'video' in content %}"
            "{% set video_count.value = video_count.value + 1 %}"
            "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
            "<|vision_start|><|video_pad|><|vision_end|>"
            "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
            "<|im_end|>\n{% endif %}")
    if marked:
        body = ("{% if message['role'] == 'assistant' %}{% generation %}" + body
                + "{% endgeneration %}{% else %}" + body + "{% endif %}")
    system = ("{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are "
              "a helpful assistant.<|im_end|>\n{% endif %}") if default_system else ""
    return ("{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
            "{% for message in messages %}" + system +
            "<|im_start|>{{ message['role'] }}\n" + body + "{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _llava(space_marked: bool) -> str:
    """`space_marked`: the space after `ASSISTANT:` inside the markers too (what the generation
    prompt `ASSISTANT:` leaves to the answer, so the turn-by-turn split's oracle)."""
    role = ("{% if message['role'] == 'assistant' %}{{ 'ASSISTANT:' }}{% else %}"
            "{{ message['role'].upper() + ': ' }}{% endif %}" if space_marked else
            "{{ message['role'].upper() + ': ' }}")
    answer = "{{ ' ' + content['text'] + ' ' }}" if space_marked else \
        "{{ content['text'] + ' ' }}"
    return ("{% for message in messages %}{% if message['role'] != 'system' %}" + role
            + "{% endif %}"
            "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
            "{{ '<image>\n' }}{% endfor %}"
            "{% if message['role'] != 'assistant' %}"
            "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
            "{{ content['text'] + ' ' }}{% endfor %}{% else %}"
            "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
            "{% generation %}" + answer + "{% endgeneration %}{% endfor %}{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


LLAVA_HF, LLAVA_HF_SPACE_MARKED = _llava(False), _llava(True)
LLAVA_HF_UNMARKED = re.sub(r"\{% (end)?generation %\}", "", LLAVA_HF)


def _llama3(marked: bool) -> str:
    body = "{{ message['content'] | trim }}<|eot_id|>"
    if marked:
        body = ("{% if message['role'] == 'assistant' %}{% generation %}" + body
                + "{% endgeneration %}{% else %}" + body + "{% endif %}")
    return ("{{ bos_token }}{% for message in messages %}<|start_header_id|>"
            "{{ message['role'] }}<|end_header_id|>\n\n" + body + "{% endfor %}"
            "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
            "{% endif %}")


QWEN2_5_VL, QWEN2_5_VL_MARKED = _qwen(False), _qwen(True)
QWEN3_VL = _qwen(False, default_system=False)
LLAMA3, LLAMA3_MARKED = _llama3(False), _llama3(True)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                 "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
LLAVA_SPECIALS = ["<unk>", "<s>", "</s>", "<image>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>", "<image>"]
WORDS = ["the", "a", "cat", "chart", "shows", "value", "of", "year", "what", "is", "in", "this",
         "picture", "answer", "USER", "ASSISTANT", "system", "user", "assistant", "You", "are",
         "helpful", "1", "2", "3", ",", ".", "?", ":"]


def corpus(seed: int = 0, lines: int = 200) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(lines)]


def byte_level_tokenizer(path: Path, template: str, specials: list[str], *,
                         bos: str | None = None, eos: str | None = None,
                         bos_processor: bool = False) -> Path:
    """A byte-level BPE tokenizer directory (every string encodes, as Qwen's and Llama-3's do)
    with `template` as its chat template; `bos_processor`: it adds `bos` to every encoding."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(corpus(), 400, specials, byte_level=True)
    if bos_processor:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    hf.chat_template = template
    hf.save_pretrained(str(path))
    return path


def model_tokenizer(path: Path, tokenizer_json: Path, template: str, ids: dict[str, int], *,
                    bos: str | None = None, eos: str | None = None,
                    bos_processor: bool = False) -> Path:
    """A dataset's tokenizer (data/formats/generate.py's, smaller than a tiny model's
    vocabulary) saved into checkpoint directory `path` with `template`: fillers up to the
    model's own tokens, which get the ids `ids` names (in order)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(tokenizer_json))
    first = min(ids.values())
    tok.add_tokens([f"filler{k}" for k in range(first - tok.get_vocab_size())])
    tok.add_special_tokens(list(ids))
    assert {t: tok.token_to_id(t) for t in ids} == ids, "the model's token ids"
    if bos_processor:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                 unk_token="<unk>")
    hf.chat_template = template
    hf.save_pretrained(str(path))
    return path
