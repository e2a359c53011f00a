"""Canonical tensors -> a Hugging Face checkpoint directory shaped like an existing one.

Why "like": the exported directory must load in transformers (or OpenGVLab's remote code) with no
missing or unexpected keys, so it mirrors the checkpoint the model came from: the same tensor
names in the same key style and dtype, the tensors the model never trains (LLaVA's unused last
CLIP layer, CLIP's post-LayerNorm) copied unchanged, and the config, tokenizer, processor and
remote-code files alongside. Tensors are written as they arrive, in safetensors shards of at most
`max_shard_bytes` with transformers' index file, so memory holds one shard.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from megatron_omnibal.models.hf_config import HFModel
from megatron_omnibal.models.hf_weights import (
    TIED_HEAD_COPIES,
    SafetensorsReader,
    WeightsError,
    rules_for,
    to_file_name,
    unused_hf_names,
)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class ShardWriter:
    """Safetensors shards named as transformers names them, with the index it reads."""

    def __init__(self, out: Path, max_shard_bytes: int) -> None:
        self.out = out
        self.max = max_shard_bytes
        self.buffer: dict[str, torch.Tensor] = {}
        self.size = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.buffer and self.size + nbytes > self.max:
            self._flush()
        self.buffer[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.buffer, str(self.out / f".shard{len(self.shards)}.tmp"), {"format": "pt"})
        self.shards.append(sorted(self.buffer))
        self.buffer, self.size = {}, 0

    def close(self) -> list[Path]:
        if self.buffer or not self.shards:
            self._flush()
        n = len(self.shards)
        if n == 1:
            names = [self.out / "model.safetensors"]
        else:
            names = [self.out / f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(names):
            (self.out / f".shard{i}.tmp").replace(final)
        if n > 1:
            index = {
                "metadata": {"total_size": self.total},
                "weight_map": {t: names[i].name for i, ts in enumerate(self.shards) for t in ts},
            }
            (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return names


def _dtypes(reader: SafetensorsReader) -> dict[str, torch.dtype]:
    """The dtype of every tensor of the original checkpoint (file names), read from headers."""
    from safetensors import safe_open

    out = {}
    for shard in sorted(set(reader.files.values())):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is no dict
                out[name] = DTYPES[f.get_slice(name).get_dtype()]
    return out


def export_hf(
    groups: Iterable[dict[str, torch.Tensor]],
    like: HFModel,
    out: Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write canonical tensors (in groups, e.g. one pipeline stage each) as an HF checkpoint
    like `like` into `out`. Every tensor of `like` is written exactly once. Returns the shards."""
    reader = SafetensorsReader(like)
    rules = {r.canonical: r for r in rules_for(like)}
    originals = _dtypes(reader)
    writer = ShardWriter(out, max_shard_bytes)
    done: set[str] = set()
    embedding = None  # a tied head's stored copy (if the original has one) is the embedding
    for group in groups:
        for name, tensor in group.items():
            rule = rules.get(name)
            if rule is None:
                raise WeightsError(f"checkpoint tensor '{name}' is not part of {like.path}'s model")
            if name in done:
                raise WeightsError(f"checkpoint tensor '{name}' appears twice")
            done.add(name)
            for hf_name, piece in zip(rule.hf, rule.to_hf(tensor), strict=True):
                file_name = to_file_name(hf_name, reader.style)
                writer.add(file_name, piece.to(dtype or originals[file_name]))
            if name == "embedding.word_embeddings.weight":
                embedding = tensor
        if progress is not None:
            progress(len(group))
    missing = sorted(set(rules) - done)
    if missing:
        raise WeightsError(f"the checkpoint lacks {len(missing)} tensor(s), e.g. '{missing[0]}'")
    for hf_name in sorted(unused_hf_names(like, reader.names())):
        file_name = to_file_name(hf_name, reader.style)
        tied_copy = hf_name in TIED_HEAD_COPIES and like.spec.llm.tie_embeddings
        tensor = embedding if tied_copy else reader.get(hf_name)
        writer.add(file_name, tensor.to(dtype or originals[file_name]))
    shards = writer.close()
    for f in sorted(like.path.iterdir()):
        weights = f.name.endswith(WEIGHT_SUFFIXES) or f.name in WEIGHT_INDEXES
        if f.is_file() and not weights:
            shutil.copy2(f, out / f.name)
    return shards
