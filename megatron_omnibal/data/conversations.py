"""One dataset record -> its images and the text pieces the LLM tokenizer will see.

Turns come from data/records.py as (role, text) with role human/gpt/system and every image's
`<image>` (video's `<video>`) placeholder in place; the k-th placeholder in the human turns
stands for the k-th image (video). Each image placeholder becomes the model's image tokens; a
video placeholder becomes its frames, one image each, labelled as transformers' InternVL
processor writes them: `Frame1: <img>...</img>\nFrame2: <img>...</img>` (the newline after
`<video>` in the text stays).

Image tokens are counted, not spelled out: a placeholder is rendered with ONE image-context
token and `extra` carries the other n - 1. That is exact because the context token is an added
special token (checked when the tokenizer loads, see tokenization.py), and it keeps a sample with
12 tiles from costing a 3,000-token string.
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
TEMPLATES = ("internvl2_5", "vicuna_v1", "qwen2_vl", "hf")


class SampleError(ValueError):
    """A record that cannot be turned into a training sample (the message says why)."""


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


def render(turns: list[tuple[str, str]], template: str, system: str | None) -> list[str]:
    """The text pieces the tokenizer encodes separately, for the built-in templates.

    internvl2_5 tokenizes every turn on its own (as InternVL's training loader does), so it
    returns one piece per turn; vicuna_v1 (LLaVA-1.5) and qwen2_vl (the ChatML of Qwen2-VL and
    Qwen2.5-VL's chat template, system "You are a helpful assistant.") return the whole prompt as
    one piece, as their processors tokenize it.
    The `hf` template is rendered by the tokenizer itself (tokenization.py).
    """
    if template == "internvl2_5":
        pieces = []
        if turns[0][0] == "system":
            system, turns = turns[0][1], turns[1:]
        elif system is None:
            system = INTERNVL_SYSTEM
        if system is not None:
            pieces.append(f"<|im_start|>system\n{system}<|im_end|>\n")
        for role, text in turns:
            pieces.append(f"<|im_start|>{ROLES[role]}\n{text}<|im_end|>\n")
        return pieces
    if template == "qwen2_vl":
        if turns[0][0] == "system":
            system, turns = turns[0][1], turns[1:]
        elif system is None:
            system = QWEN_SYSTEM
        return ["".join(f"<|im_start|>{ROLES[role]}\n{text}<|im_end|>\n"
                        for role, text in [("system", system), *turns])]
    if template == "vicuna_v1":
        if turns[0][0] == "system":
            system, turns = turns[0][1], turns[1:]
        elif system is None:
            system = VICUNA_SYSTEM
        text = system + " "
        for role, value in turns:
            text += f"USER: {value} " if role == "human" else f"ASSISTANT: {value}</s>"
        return [text]
    raise ValueError(f"unknown template {template!r} (choose from {', '.join(TEMPLATES)})")
