"""Token counts with the model's own tokenizer, loaded from a local path (nothing downloaded).

A directory is loaded with transformers' AutoTokenizer (its chat template included, or the
processor's chat_template.json where the tokenizer has none); a `tokenizer.json` file with the
`tokenizers` library. A directory whose tokenizer comes with its own Python code
(tokenizer_config.json `auto_map`, e.g. InternLM2's for InternVL2.5) is loaded only with
`trust_remote_code`: that code runs on this machine. Image tokens the tokenizer lacks are added
as special tokens, as InternVL's training script does before training, so that counting here
matches what the model will see. Encoding goes through the Rust backend in batches.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megatron_omnibal.data.text.conversations import ChatText, ImageStyle, video_style

_CACHE_TEXT_CHARS = 512  # remember counts of pieces up to this long
_CACHE_ENTRIES = 1 << 18


class TokenCounter:
    """Counts the tokens of text pieces; `specials` is what the tokenizer adds per sequence."""

    def __init__(self, path: str | os.PathLike, image_style: ImageStyle,
                 trust_remote_code: bool = False) -> None:
        path = Path(path)
        self.path = path
        self.hf = None
        self._cache: dict[str, int] = {}
        if path.is_file():
            from tokenizers import Tokenizer

            try:
                self.backend = Tokenizer.from_file(str(path))
            except Exception as exc:  # the Rust loader raises a bare Exception
                raise ValueError(f"{path}: not a tokenizers JSON file ({exc})") from exc
        elif path.is_dir():
            from transformers import AutoTokenizer

            custom = _custom_code(path)
            if custom and not trust_remote_code:
                raise ValueError(f"{path}: the tokenizer comes with its own code ({custom}); "
                                 "pass --trust-remote-code to run it (only for a tokenizer "
                                 "you trust)")
            try:
                self.hf = AutoTokenizer.from_pretrained(
                    str(path), local_files_only=True, trust_remote_code=trust_remote_code)
            except (OSError, ValueError, ImportError) as exc:
                raise ValueError(f"{path}: cannot load a tokenizer ({exc})") from exc
            self.backend = self.hf.backend_tokenizer if self.hf.is_fast else None
            if not getattr(self.hf, "chat_template", None):
                self.hf.chat_template = _processor_template(path)
        else:
            raise FileNotFoundError(f"{path}: no tokenizer directory or tokenizer.json file")
        video = video_style(image_style)
        self.added = self._add_missing([image_style.start, image_style.context, image_style.end,
                                        video.context if video else ""])
        self._check_counting(image_style.context)
        if video:
            self._check_counting(video.context)
        if self.backend is not None:
            self.specials = self.backend.num_special_tokens_to_add(False)
        else:
            self.specials = self.hf.num_special_tokens_to_add(pair=False)

    def token_id(self, token: str) -> int | None:
        """The id of a single-token string (None if it is not one token)."""
        ids = self._encode(token)
        return None if ids is None else ids[0]

    def fingerprint(self) -> str:
        """A hash of what decides the token ids: the vocabulary (added tokens included), the
        per-sequence special tokens and the ids of probe texts (normalizer, pre-tokenizer).
        Training compares it with the one `omnibal stats` stored, so a length file is never
        used with another tokenizer by accident."""
        if self.backend is not None:
            vocab = self.backend.get_vocab(with_added_tokens=True)
        else:
            vocab = self.hf.get_vocab()
        probe = ["Hello, world! 12 34", "  two  spaces\nnew line", "é中文 <image> ok"]
        doc = {"vocab": sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])),
               "specials": self.specials, "probe": [self._ids(t) for t in probe]}
        return hashlib.sha256(json.dumps(doc, ensure_ascii=False).encode()).hexdigest()[:16]

    def _ids(self, text: str) -> list[int]:
        if self.backend is not None:
            return list(self.backend.encode(text, add_special_tokens=False).ids)
        return list(self.hf.encode(text, add_special_tokens=False))

    def count(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text, without the tokenizer's per-sequence special tokens.

        Short pieces repeat across a dataset (the system turn, templated questions, "Yes."), so
        their counts are remembered; every distinct text is still encoded once.
        """
        cache = self._cache
        todo = list(dict.fromkeys(t for t in texts if t not in cache))
        fresh = dict(zip(todo, self._encode_lengths(todo), strict=True))
        counts = [fresh[t] if t in fresh else cache[t] for t in texts]
        for text, n in fresh.items():
            if len(text) <= _CACHE_TEXT_CHARS:
                if len(cache) >= _CACHE_ENTRIES:
                    cache.clear()
                cache[text] = n
        return counts

    def _encode_lengths(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        if self.backend is not None:
            # len(encoding) counts tokens without building the list of ids
            return [len(e) for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]
        return [len(x) for x in self.hf(texts, add_special_tokens=False)["input_ids"]]

    def encode_chat(self, chat: ChatText) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, answer flags) of a rendered conversation, the tokens `count` counts:
        pieces encoded apart, the tokenizer's specials once where the template does not write
        them. A token is an answer's when it overlaps an answer span, as transformers' assistant
        mask marks it. Needs the fast (Rust) tokenizer, whose offsets locate the answers."""
        from tokenizers import Encoding

        backend = self.backend
        if backend is None:
            raise ValueError(f"{self.path}: training samples need a fast tokenizer (token "
                             "offsets locate the answers)")
        encodings = backend.encode_batch(chat.pieces, add_special_tokens=False)
        flags, start = [], 0
        for piece, enc in zip(chat.pieces, encodings, strict=True):
            flags.extend(any(a < start + e and start + s < b for a, b in chat.answers)
                         for s, e in enc.offsets)
            start += len(piece)
        merged = Encoding.merge(encodings, growing_offsets=True)
        if not chat.specials:
            return np.asarray(merged.ids, np.int64), np.asarray(flags, bool)
        full = backend.post_process(merged)
        target = np.zeros(len(full.ids), bool)
        target[np.array([s is not None for s in full.sequence_ids], bool)] = flags
        return np.asarray(full.ids, np.int64), target

    def _single_id(self, token: str) -> bool:
        return self._encode(token) is not None

    def _encode(self, text: str) -> list[int] | None:
        ids = self._ids(text)
        return ids if len(ids) == 1 else None

    def _add_missing(self, tokens: Sequence[str]) -> list[str]:
        missing = [t for t in dict.fromkeys(tokens) if t and not self._single_id(t)]
        if missing:
            if self.hf is not None:
                self.hf.add_tokens(missing, special_tokens=True)
            else:
                self.backend.add_special_tokens(missing)
        return missing

    def _check_counting(self, context: str) -> None:
        """Image tokens are counted as len(text with one context token) + (n - 1): check it."""
        one, five = self.count([f"a{context}b", f"a{context * 5}b"])
        if five - one != 4:
            raise ValueError(f"{self.path}: '{context}' is not encoded as one token per "
                             "occurrence; image tokens cannot be counted")


def _processor_template(path: Path) -> str | None:
    """The chat template a checkpoint keeps for its processor only (chat_template.json, as
    some llava-hf releases do), which AutoTokenizer does not load but the processor uses."""
    try:
        doc = json.loads((path / "chat_template.json").read_text())
    except (OSError, ValueError):
        return None
    template = doc.get("chat_template") if isinstance(doc, dict) else None
    return template if isinstance(template, str) and template else None


def _custom_code(path: Path) -> str | None:
    """What a tokenizer directory's auto_map asks transformers to import, if anything."""
    for name in ("tokenizer_config.json", "config.json"):
        try:
            doc = json.loads((path / name).read_text())
        except (OSError, ValueError):
            continue
        entry = (doc.get("auto_map") or {}).get("AutoTokenizer") if isinstance(doc, dict) \
            else None
        if entry:
            names = [e for e in (entry if isinstance(entry, list) else [entry]) if e]
            return f"{name} auto_map AutoTokenizer: {', '.join(names)}"
    return None
