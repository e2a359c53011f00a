"""The checkpoint's own chat template (the `hf` template): a conversation rendered by the
tokenizer's Jinja template, and the characters of it that carry the loss.

Released checkpoints carry their template (Qwen2.5-VL-Instruct: ChatML with a default system
prompt; llava-hf: `USER: ... ASSISTANT: ...` over typed content parts; Llama-3: header tokens).
What the template is handed:
- a template that renders string contents gets each turn's text with every image (video)
  placeholder written inline as the model's image: `<|vision_start|><|image_pad|><|vision_end|>`,
  `<image>` (the way Qwen's own fine-tuning and LLaMA-Factory write LLaVA-format data);
- a template that renders only typed parts (llava-hf's) gets `{"type": "text"}`,
  `{"type": "image"}` and `{"type": "video"}` parts in the placeholders' order, as a processor's
  user writes them, and writes each image its own way; the whitespace next to a placeholder is
  dropped (LLaVA data's `<image>\\n`: these templates write their own around an image).
Either way the rendered text must hold one image-context token per image, which the model's
processor then repeats per image token (the caller counts them, training spells them out). The
text is tokenized as a processor tokenizes a rendered conversation: with the tokenizer's own
special tokens (llava-hf's BOS), unless the text already starts with its BOS (Llama-3's
template writes it).

The loss: where the template has `{% generation %}` markers, exactly the tokens transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks, one marked span per
answer. Otherwise each answer is found by rendering turn by turn: the text that the
conversation up to the answer adds after the prompt up to it with the generation prompt (the
answer and what closes its turn, e.g. `answer<|im_end|>\\n`). That text must be non-empty and
hold the answer, and the whole conversation must start with the text up to the answer (a
template that rewrites earlier turns is not prefix-stable): otherwise the sample is refused
with the reason (`SampleError`; the caller names the record).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

from megatron_omnibal.data.text.conversations import (
    IMAGE_PLACEHOLDER,
    ROLES,
    VIDEO_PLACEHOLDER,
    ChatText,
    ImageStyle,
    Media,
    SampleError,
    expand_media,
    video_style,
)

GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")
_PROBE = ("omnibal probe question", "omnibal probe answer")


class HfChatTemplate:
    """Renders conversations with a transformers tokenizer's chat template (checked on
    construction: it renders a question and an answer, the system message when one is given,
    and answers a loss can be put on)."""

    def __init__(self, tokenizer: Any, where: str, style: ImageStyle,
                 system: str | None) -> None:
        template = _template_of(tokenizer)
        if template is None:
            raise ValueError(f"{where}: the 'hf' template needs a tokenizer directory with a "
                             "chat template")
        self.tokenizer, self.where, self.style, self.system = tokenizer, where, style, system
        self.sha = hashlib.sha256(template.encode()).hexdigest()[:16]
        self.markers = bool(GENERATION.search(template))
        if self.markers and not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{where}: its chat template marks answers with {{% generation %}}, "
                             "which transformers reads with a fast tokenizer only")
        self.parts = self._takes_parts_only()
        try:
            self.render([("human", _PROBE[0]), ("gpt", _PROBE[1])], [])
        except SampleError as exc:
            raise ValueError(f"{where}: its chat template cannot train: {exc}") from None

    def _takes_parts_only(self) -> bool:
        """False: the template renders string contents; True: only typed parts."""
        question, answer = _PROBE
        for parts in (False, True):
            messages = [self._message("user", question, [], parts),
                        self._message("assistant", answer, [], parts)]
            try:
                text = self._render(messages, False)
            except SampleError:
                continue
            if question in text and "'type'" not in text:
                return parts
        raise ValueError(f"{self.where}: its chat template renders neither string contents nor "
                         "typed parts ({'type': 'text', 'text': ...}) of a user message")

    def render(self, turns: list[tuple[str, str]], media: Sequence[Media]) -> ChatText:
        """The conversation (placeholders in place, `media` in their order) and its answers'
        spans; SampleError says why a conversation cannot be trained."""
        messages = self.messages(turns, media)
        text = self._render(messages, False)
        if messages[0]["role"] == "system":
            system = turns[0][1] if turns[0][0] == "system" else self.system
            if system.strip() and system.strip() not in text:
                raise SampleError("the chat template drops the system message (it renders no "
                                  f"{system.strip()[:40]!r}); give no system prompt or "
                                  "another template")
        answers = [t for role, t in turns if role == "gpt"]
        spans = self._marked(messages, len(answers)) if self.markers else \
            self._turn_by_turn(messages, text, answers)
        self._check_media(text, media)
        bos = getattr(self.tokenizer, "bos_token", None)
        return ChatText([text], spans, specials=not (bos and text.startswith(bos)))

    def messages(self, turns: list[tuple[str, str]], media: Sequence[Media]) -> list[dict]:
        """The messages handed to the template (a system message first when one is set)."""
        if not self.parts:
            turns = expand_media(turns, media)
        queues = {p: [m for m in media if m.placeholder == p]
                  for p in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER)}
        out = []
        if self.system is not None and turns[0][0] != "system":
            out.append(self._message("system", self.system, queues, self.parts))
        for role, text in turns:
            out.append(self._message(ROLES[role], text, queues, self.parts))
        return out

    @staticmethod
    def _message(role: str, text: str, queues: Any, parts: bool) -> dict:
        """The string, or typed parts with the next media of `queues` at each placeholder."""
        if not parts:
            return {"role": role, "content": text}
        content = []
        pieces = PLACEHOLDERS.split(text)
        for k, piece in enumerate(pieces):
            if k % 2:
                content.append(dict(queues[piece].pop(0).part))
                continue
            if k:
                piece = piece.lstrip()
            if k < len(pieces) - 1:
                piece = piece.rstrip()
            if piece:
                content.append({"type": "text", "text": piece})
        return {"role": role, "content": content}

    def _render(self, messages: list[dict], prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=prompt)
        except Exception as exc:  # a template's own error (raise_exception), any Jinja error
            raise SampleError(f"the chat template fails: {type(exc).__name__}: {exc}") from None

    def _turn_by_turn(self, messages: list[dict], text: str,
                      answers: list[str]) -> list[tuple[int, int]]:
        """Each answer's span: what rendering through it adds to the prompt before it."""
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            n = len(spans) + 1
            before = self._render(messages[:i], True)
            through = text if i == len(messages) - 1 else self._render(messages[:i + 1], False)
            if not (through.startswith(before) and text.startswith(through)):
                raise SampleError(
                    f"answer {n}: the chat template renders the conversation up to it otherwise "
                    "than within the whole conversation (not prefix-stable), so its tokens are "
                    "no span that can carry the loss; use a template with {% generation %} "
                    "markers or another template")
            if len(through) == len(before):
                raise SampleError(f"answer {n}: the chat template renders nothing for it")
            if answers[n - 1].strip() not in through[len(before):]:
                raise SampleError(f"answer {n}: the chat template does not write it where the "
                                  "assistant's turn is")
            spans.append((len(before), len(through)))
        return spans

    def _marked(self, messages: list[dict], answers: int) -> list[tuple[int, int]]:
        """Spans of the tokens transformers marks inside {% generation %} blocks."""
        try:
            out = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        except Exception as exc:  # as in _render
            raise SampleError(f"the chat template fails: {type(exc).__name__}: {exc}") from None
        offsets = out.encodings[0].offsets
        spans: list[tuple[int, int]] = []
        previous = 0
        for (start, end), marked in zip(offsets, out["assistant_masks"], strict=True):
            if marked and previous:
                spans[-1] = (spans[-1][0], max(spans[-1][1], end))
            elif marked:
                spans.append((start, end))
            previous = marked
        if len(spans) != answers or any(s == e for s, e in spans):
            raise SampleError(f"the chat template's {{% generation %}} markers cover "
                              f"{len(spans)} span(s) for {answers} answer(s): it renders an "
                              "answer outside them, or nothing for it")
        return spans

    def _check_media(self, text: str, media: Sequence[Media]) -> None:
        """One context token per image (video) in the text, as the caller counts them."""
        for style in (self.style, video_style(self.style)):
            if style is None:
                continue
            want = sum(m.text.count(style.context) for m in media)
            found = text.count(style.context)
            if found != want:
                raise SampleError(f"the chat template writes {found} '{style.context}' for "
                                  f"{want} expected (one per image or video)")


def _template_of(tokenizer: Any) -> str | None:
    """The tokenizer's default chat template, None if it has none."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    try:
        template = tokenizer.get_chat_template()
    except ValueError:
        return None
    return template if isinstance(template, str) else None
