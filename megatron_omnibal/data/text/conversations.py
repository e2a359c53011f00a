"""One dataset record -> its images and the text pieces the LLM tokenizer will see.

Turns come from data/formats/records.py as (role, text) with role human/gpt/system and every image's
`<image>` (video's `<video>`) placeholder in place; the k-th placeholder in the human turns
stands for the k-th image (video). Each image placeholder becomes the model's image tokens; a
video placeholder becomes its frames, one image each, labelled as transformers' InternVL
processor writes them: `Frame1: <img>...</img>\nFrame2: <img>...</img>` (the newline after
`<video>` in the text stays).

Image tokens are counted, not spelled out: a placeholder is rendered with ONE image-context
token and `extra` carries the other n - 1. That is exact because the context token is an added
special token (checked when the tokenizer loads, see tokenization.py), and it keeps a sample with
12 tiles from costing a 3,000-token string.

A rendered conversation is a `ChatText`: the pieces the tokenizer encodes apart, the character
spans the loss covers (each answer and what closes its turn: `<|im_end|>\n`, `</s>`, as InternVL
and LLaVA train) and whether the tokenizer adds its per-sequence special tokens. `omnibal stats`
counts its tokens and training encodes the same pieces, so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
INTERNVL_SYSTEM = ("你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位"
                   "联合开发的多模态大语言模型。")
VICUNA_SYSTEM = ("A chat between a curious human and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the human's "
                 "questions.")
QWEN_SYSTEM = "You are a helpful assistant."
DEFAULT_SYSTEM = {"internvl2_5": INTERNVL_SYSTEM, "vicuna_v1": VICUNA_SYSTEM,
                  "qwen2_vl": QWEN_SYSTEM}
BUILT_IN = ("internvl2_5", "vicuna_v1", "qwen2_vl")
TEMPLATES = (*BUILT_IN, "hf")  # hf: the checkpoint tokenizer's own chat template


class SampleError(ValueError):
    """A record that cannot be turned into a training sample (the message says why)."""


@dataclass(frozen=True)
class ChatText:
    """A conversation as the tokenizer sees it: `pieces` are encoded apart and concatenated,
    `answers` are character spans of "".join(pieces) that carry the loss, `specials`: the
    tokenizer adds its per-sequence special tokens (a checkpoint's own template writes them)."""

    pieces: list[str]
    answers: list[tuple[int, int]]
    specials: bool = True


@dataclass(frozen=True)
class ImageStyle:
    """How an image appears in the LLM input: `start` + `context` * n + `end`."""

    start: str
    context: str
    end: str

    def compact(self) -> str:
        """The image with a single context token; the other n - 1 are counted, not spelled."""
        return f"{self.start}{self.context}{self.end}"


INTERNVL_IMAGE = ImageStyle("<img>", "<IMG_CONTEXT>", "</img>")
LLAVA_IMAGE = ImageStyle("", "<image>", "")
QWEN_VL_IMAGE = ImageStyle("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
QWEN_VL_VIDEO = ImageStyle("<|vision_start|>", "<|video_pad|>", "<|vision_end|>")


@dataclass(frozen=True)
class Media:
    """One image or video of a sample, as its placeholder becomes text: `text` inline in the
    turn, or `part` for a chat template that takes typed content parts."""

    placeholder: str
    text: str
    part: tuple[tuple[str, str], ...]  # the part's items: (("type", "image"),)

    @classmethod
    def image(cls, style: ImageStyle) -> Media:
        return cls(IMAGE_PLACEHOLDER, style.compact(), (("type", "image"),))

    @classmethod
    def native_video(cls, style: ImageStyle) -> Media:
        """A whole video in the model's own video tokens (Qwen2.5-VL)."""
        return cls(VIDEO_PLACEHOLDER, style.compact(), (("type", "video"),))

    @classmethod
    def frames(cls, frames: int, style: ImageStyle) -> Media:
        """A video as `frames` labelled images (InternVL): text to every template."""
        text = video_text(frames, style)
        return cls(VIDEO_PLACEHOLDER, text, (("type", "text"), ("text", text)))


def video_style(style: ImageStyle) -> ImageStyle | None:
    """How a whole video appears for a model that takes videos natively (Qwen2.5-VL: its own
    pad token); None: videos are frames, each an image."""
    return QWEN_VL_VIDEO if style == QWEN_VL_IMAGE else None


def frame_label(k: int) -> str:
    """The text before frame k (1-based) of a video, after the previous frame's image."""
    return f"Frame{k}: " if k == 1 else f"\nFrame{k}: "


def video_text(frames: int, style: ImageStyle) -> str:
    """A video of `frames` frames, each an image in its compact form."""
    return "".join(frame_label(k) + style.compact() for k in range(1, frames + 1))


def expand_media(turns: list[tuple[str, str]], media: Sequence[Media]) -> list[tuple[str, str]]:
    """Each placeholder spelled as its media's inline text (images and videos counted apart)."""
    for placeholder in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER):
        mine = [m.text for m in media if m.placeholder == placeholder]
        if mine:
            turns = expand_images(turns, mine, placeholder)
    return turns


def expand_images(turns: list[tuple[str, str]], image_text: Sequence[str],
                  placeholder: str = IMAGE_PLACEHOLDER) -> list[tuple[str, str]]:
    """Replace the k-th placeholder (in human turns) by image_text[k]."""
    out, k = [], 0
    for role, text in turns:
        if role == "human" and placeholder in text:
            parts = text.split(placeholder)
            pieces = [parts[0]]
            for part in parts[1:]:
                pieces.append(image_text[k])
                pieces.append(part)
                k += 1
            text = "".join(pieces)
        out.append((role, text))
    return out


def render(turns: list[tuple[str, str]], template: str, system: str | None) -> ChatText:
    """The text pieces the tokenizer encodes separately and the answers' spans, for the
    built-in templates.

    internvl2_5 tokenizes every turn on its own (as InternVL's training loader does), so it
    has one piece per turn; vicuna_v1 (LLaVA-1.5) and qwen2_vl (the ChatML of Qwen2-VL and
    Qwen2.5-VL's chat template, system "You are a helpful assistant.") the whole prompt as one
    piece, as their processors tokenize it.
    The `hf` template is rendered by the tokenizer's own (chat_template.py).
    """
    if template not in BUILT_IN:
        raise ValueError(f"unknown template {template!r} (choose from {', '.join(TEMPLATES)})")
    if turns[0][0] == "system":
        system, turns = turns[0][1], turns[1:]
    elif system is None:
        system = DEFAULT_SYSTEM[template]
    if template == "vicuna_v1":
        parts = [(system + " ", False)]
        for role, value in turns:
            parts += ([(f"USER: {value} ", False)] if role == "human" else
                      [("ASSISTANT: ", False), (f"{value}</s>", True)])
        return _chat_text(parts, one_piece=True)
    parts = [(f"<|im_start|>system\n{system}<|im_end|>\n", False)]
    for role, text in turns:
        parts.append((f"<|im_start|>{ROLES[role]}\n", False))
        parts.append((f"{text}<|im_end|>\n", role == "gpt"))
    return _chat_text(parts, one_piece=template == "qwen2_vl", turn_pieces=2)


def _chat_text(parts: list[tuple[str, bool]], one_piece: bool, turn_pieces: int = 1
               ) -> ChatText:
    """Pieces (the whole text, or one per turn of `turn_pieces` parts after the system's) and
    the spans of the parts flagged as answers."""
    answers, start = [], 0
    for text, answer in parts:
        if answer:
            answers.append((start, start + len(text)))
        start += len(text)
    if one_piece:
        return ChatText(["".join(t for t, _ in parts)], answers)
    first = len(parts) % turn_pieces
    pieces = [t for t, _ in parts[:first]] + [
        "".join(t for t, _ in parts[k:k + turn_pieces])
        for k in range(first, len(parts), turn_pieces)]
    return ChatText(pieces, answers)
