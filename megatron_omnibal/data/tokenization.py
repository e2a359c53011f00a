"""Token counts with the model's own tokenizer, loaded from a local path (nothing downloaded).

A directory is loaded with transformers' AutoTokenizer (its chat template included); a
`tokenizer.json` file with the `tokenizers` library. Image tokens the tokenizer lacks are added
as special tokens, as InternVL's training script does before training, so that counting here
matches what the model will see. Encoding goes through the Rust backend in batches.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from megatron_omnibal.data.conversations import ROLES, ImageStyle

_CACHE_TEXT_CHARS = 512  # remember counts of pieces up to this long
_CACHE_ENTRIES = 1 << 18


class TokenCounter:
    """Counts the tokens of text pieces; `specials` is what the tokenizer adds per sequence."""

    def __init__(self, path: str | os.PathLike, image_style: ImageStyle) -> None:
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

            try:
                self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except (OSError, ValueError) as exc:
                raise ValueError(f"{path}: cannot load a tokenizer ({exc})") from exc
            self.backend = self.hf.backend_tokenizer if self.hf.is_fast else None
        else:
            raise FileNotFoundError(f"{path}: no tokenizer directory or tokenizer.json file")
        self.added = self._add_missing([image_style.start, image_style.context, image_style.end])
        self._check_counting(image_style.context)
        if self.backend is not None:
            self.specials = self.backend.num_special_tokens_to_add(False)
        else:
            self.specials = self.hf.num_special_tokens_to_add(pair=False)

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

    def render_chat(self, turns: list[tuple[str, str]], system: str | None) -> str:
        """The conversation rendered by the tokenizer's own chat template (the `hf` template)."""
        if self.hf is None or not getattr(self.hf, "chat_template", None):
            raise ValueError(f"{self.path}: the 'hf' template needs a tokenizer directory with "
                             "a chat template")
        messages = [{"role": ROLES[role], "content": text} for role, text in turns]
        if system is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        return self.hf.apply_chat_template(messages, tokenize=False)

    def _single_id(self, token: str) -> bool:
        return self._encode(token) is not None

    def _encode(self, text: str) -> list[int] | None:
        if self.backend is not None:
            ids = self.backend.encode(text, add_special_tokens=False).ids
        else:
            ids = self.hf.encode(text, add_special_tokens=False)
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
