"""One annotation record -> its image paths and checked (role, text) turns, whatever its shape.

Shapes read (one reader, so `omnibal stats` and the training loader agree):
- LLaVA / InternVL: {"id", "image": path | [paths], "conversations": [{"from", "value"}...]}
- ShareGPT (LLaMA-Factory): {"conversations": [{"from", "value"}...], "images": [paths],
  "system"?}
- OpenAI-style messages (ms-swift, LLaMA-Factory): {"messages": [{"role", "content"}...],
  "images": [paths]}; `content` is a string, or a list of {"type": "text", "text"} and
  {"type": "image"} parts (an image part is a placeholder).

Videos: InternVL's `video` (one path, optional `clip`: [start_s, end_s]) or a ShareGPT /
messages `videos` list (paths, or {"path"} objects), with `<video>` placeholders (a messages
content part {"type": "video"} is one). A sample holds images or videos, not both (InternVL's
loader has no such sample either).

Every key of a record must be understood: a key this reader does not know (an "audios" list, a
misspelt "imgs", tool calls) is an error, never a sample silently counted as text-only. Keys that
carry no content (`id`, InternVL's `width`/`height`, ...) are accepted; more can be named.

Placeholders: the k-th `<image>` in the user turns is the k-th image (`<video>`: video). A single
`image` (`video`) path without one gets `<image>\\n` (`<video>\\n`) in front of the first user
turn (InternVL's loader does this); an `images` (`videos`) list without any placeholder gets one
per item there, in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from megatron_omnibal.data.text.conversations import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    SampleError,
)

# Keys that describe a record without changing what the model sees.
METADATA_KEYS = frozenset({"id", "width", "height", "model", "source", "data_source",
                           "dataset", "meta", "metadata"})
CONTENT_KEYS = frozenset({"conversations", "messages", "image", "images", "video", "videos",
                          "clip", "system"})
UNSUPPORTED = {"audio": "audio", "audios": "audio", "tools": "tool-call",
               "objects": "grounding-object"}
_FROM = {"human": "human", "user": "human", "gpt": "gpt", "assistant": "gpt",
         "system": "system"}


@dataclass(frozen=True)
class Video:
    """A video of a sample: its path and the part of it used ([start_s, end_s], or all)."""

    path: str
    clip: tuple[float, float] | None = None


def read_sample(record: dict, extra_keys: Iterable[str] = ()
                ) -> tuple[list[str], list[Video], list[tuple]]:
    """(image paths, videos, turns) of a record: turns are (role, text) with role
    human/gpt/system, checked (optional system first, then human/gpt alternating) and with
    every image's and video's placeholder in place."""
    _check_keys(record, extra_keys)
    images, key = _images(record, "image", "images")
    paths, video_key = _images(record, "video", "videos")
    if images and paths:
        raise SampleError("images and videos in one sample are not supported")
    clip = _clip(record, video_key, len(paths))
    turns = _turns(record)
    turns = _place(turns, images, key, IMAGE_PLACEHOLDER)
    turns = _place(turns, paths, video_key, VIDEO_PLACEHOLDER)
    return images, [Video(p, clip) for p in paths], turns


def _check_keys(record: dict, extra_keys: Iterable[str]) -> None:
    for key in record:
        if key in UNSUPPORTED:
            if record[key] in (None, "", []):
                continue
            raise SampleError(f"{UNSUPPORTED[key]} samples are not supported ('{key}')")
        if key not in CONTENT_KEYS and key not in METADATA_KEYS and key not in extra_keys:
            raise SampleError(
                f"unknown key '{key}' (a record has 'conversations' or 'messages', optional "
                f"'image'/'images' or 'video'/'videos' (and 'clip'), 'system', and metadata "
                f"{sorted(METADATA_KEYS)}; "
                "`omnibal stats --extra-keys` names more keys that carry no content)")
    for one, many in (("image", "images"), ("video", "videos")):
        if one in record and many in record:
            raise SampleError(f"both '{one}' and '{many}': give one of them")
    if "conversations" in record and "messages" in record:
        raise SampleError("both 'conversations' and 'messages': give one of them")


def _images(record: dict, one: str, many: str) -> tuple[list[str], str]:
    """The paths under key `one` (a path or a list) or `many` (a list), and the key used."""
    key = many if many in record else one
    value = record.get(key)
    if value is None or value == "" or value == []:
        return [], key
    if isinstance(value, str) and key == one:
        return [value], key
    if isinstance(value, list) and all(isinstance(p, str) and p for p in value):
        return list(value), key
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("path"), str)
                                       for p in value):
        return [p["path"] for p in value], key  # [{"path": ...}] (ms-swift also accepts it)
    want = "a path or a list of paths" if key == one else "a list of paths"
    raise SampleError(f"'{key}' must be {want}, got {value!r:.80}")


def _clip(record: dict, key: str, videos: int) -> tuple[float, float] | None:
    """InternVL's `clip` [start_s, end_s] of a single `video`."""
    clip = record.get("clip")
    if clip is None:
        return None
    if key != "video" or videos != 1:
        raise SampleError("'clip' belongs to a single 'video' path")
    if (not isinstance(clip, list) or len(clip) != 2
            or not all(isinstance(t, int | float) and not isinstance(t, bool) for t in clip)
            or not 0 <= clip[0] < clip[1]):
        raise SampleError(f"'clip' must be [start_s, end_s] with 0 <= start < end, got "
                          f"{clip!r:.80}")
    return float(clip[0]), float(clip[1])


def _turns(record: dict) -> list[tuple[str, str]]:
    if "messages" in record:
        raw, role_key, text_key, where = record["messages"], "role", "content", "messages"
    else:
        raw, role_key, text_key, where = record.get("conversations"), "from", "value", \
            "conversations"
    if not isinstance(raw, list) or not raw:
        raise SampleError(f"'{where}' must be a non-empty list"
                          if where in record else "no 'conversations' or 'messages'")
    turns = []
    for k, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise SampleError(f"{where} turn {k} must be {{'{role_key}', '{text_key}'}}")
        role = _FROM.get(msg.get(role_key))
        if role is None:
            raise SampleError(f"{where} turn {k}: unknown role {msg.get(role_key)!r} "
                              "(expected human/user, gpt/assistant or system)")
        turns.append((role, _text(msg.get(text_key), where, k, text_key)))
    system, offset = record.get("system"), 0
    if system not in (None, ""):
        if not isinstance(system, str):
            raise SampleError(f"'system' must be a string, got {system!r:.80}")
        if turns[0][0] == "system":
            raise SampleError("a 'system' key and a system turn: give one of them")
        turns.insert(0, ("system", system))
        offset = 1
    first = 1 if turns[0][0] == "system" else 0
    for k in range(first, len(turns)):
        expected = "human" if (k - first) % 2 == 0 else "gpt"
        if turns[k][0] != expected:
            raise SampleError(f"{where} turn {k - offset}: "
                              f"expected '{expected}', got '{turns[k][0]}'")
    if first == len(turns):
        raise SampleError("conversation has no human turn")
    return turns


def _text(content: object, where: str, k: int, key: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            elif kind in ("image", "video"):
                out.append(IMAGE_PLACEHOLDER if kind == "image" else VIDEO_PLACEHOLDER)
            else:
                raise SampleError(f"{where} turn {k}: content part {part!r:.60} is none of "
                                  "{'type': 'text', 'text'}, {'type': 'image'}, "
                                  "{'type': 'video'}")
        return "".join(out)
    raise SampleError(f"{where} turn {k} must have a string '{key}', got {content!r:.60}")


def _place(turns: list[tuple[str, str]], paths: list[str], key: str,
           placeholder: str) -> list[tuple[str, str]]:
    """Check that placeholders match the items; add the missing ones where the shape allows."""
    n = len(paths)
    found = sum(text.count(placeholder) for role, text in turns if role == "human")
    if found == 0 and n and (key.endswith("s") or n == 1):
        k = next(i for i, (role, _) in enumerate(turns) if role == "human")
        turns = list(turns)
        turns[k] = ("human", f"{placeholder}\n" * n + turns[k][1])
        found = n
    if found != n:
        what = "image" if placeholder == IMAGE_PLACEHOLDER else "video"
        raise SampleError(f"{n} {what}(s) but {found} '{placeholder}' "
                          "placeholder(s) in the human turns")
    if any(placeholder in text for role, text in turns if role != "human"):
        raise SampleError(f"'{placeholder}' placeholder outside a human turn")
    return turns
