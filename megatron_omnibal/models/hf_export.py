"""Canonical tensors -> a Hugging Face checkpoint directory shaped like an existing one.

Why "like": the exported directory must load in transformers (or OpenGVLab's remote code) with no
missing or unexpected keys, so it mirrors the checkpoint the model came from: the same tensor
names in the same key style and dtype, the tensors the model never trains (LLaVA's unused last
CLIP layer, CLIP's post-LayerNorm) copied unchanged, and the config, tokenizer, processor and
remote-code files alongside. The shard files are laid out (headers, sizes) before any tensor
arrives, and each tensor is written to its place as it comes, so memory holds one group of
tensors (a pipeline stage), never a shard or the model.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_omnibal.models.hf_config import HFModel
from megatron_omnibal.models.hf_weights import (
    TIED_HEAD_COPIES,
    SafetensorsReader,
    WeightsError,
    canonical_shapes,
    rules_for,
    split_slice,
    to_file_name,
    unused_hf_names,
)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}


@dataclass(frozen=True)
class Slot:
    """Where one tensor goes: its shard file, dtype, shape and byte range in the data buffer."""

    file: str
    dtype: str  # safetensors' name (BF16, F32, ...)
    shape: tuple[int, ...]
    begin: int
    end: int


class ShardWriter:
    """Safetensors shards whose layout is fixed before any tensor arrives, so each tensor is
    written to its place on arrival and memory holds one pipeline stage, not one shard.

    The shards mirror the original checkpoint's: the same files holding the same tensors when
    it is sharded (transformers' index format), else one `model.safetensors`, split greedily
    in the original order into `model-XXXXX-of-YYYYY.safetensors` above `max_shard_bytes`.
    """

    def __init__(
        self,
        out: Path,
        tensors: dict[str, tuple[str, tuple[int, ...]]],
        groups: dict[str, list[str]] | None,
        max_shard_bytes: int,
    ) -> None:
        self.out = out
        if groups is None:
            groups = _greedy_shards(tensors, max_shard_bytes)
        self.slots: dict[str, Slot] = {}
        self.headers: dict[str, int] = {}
        for file, names in groups.items():
            header: dict[str, object] = {"__metadata__": {"format": "pt"}}
            at = 0
            for name in names:
                dtype, shape = tensors[name]
                end = at + DTYPE_BYTES[dtype] * math.prod(shape)
                self.slots[name] = Slot(file, dtype, tuple(shape), at, end)
                header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, end]}
                at = end
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)
            with open(out / file, "wb") as f:
                f.write(len(text).to_bytes(8, "little"))
                f.write(text)
                f.truncate(8 + len(text) + at)
            self.headers[file] = 8 + len(text)
        self.written: set[str] = set()
        self.parts: dict[str, set[int]] = {}  # slices written of fused tensors
        if len(groups) > 1:
            index = {
                "metadata": {"total_size": sum(s.end - s.begin for s in self.slots.values())},
                "weight_map": {n: s.file for n, s in sorted(self.slots.items())},
            }
            (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write tensor `name`, or with `x[i]` slice i of tensor x (its first axis): a fused
        tensor is complete once every slice is written."""
        name, index = split_slice(name)
        slot = self.slots.get(name)
        if slot is None:
            raise WeightsError(f"tensor '{name}' is not in the checkpoint being mirrored")
        shape = slot.shape if index is None else slot.shape[1:]
        where = name if index is None else f"{name}[{index}]"
        if name in self.written or (index is not None and index in self.parts.get(name, ())):
            raise WeightsError(f"tensor '{where}' written twice")
        if DTYPE_NAMES[tensor.dtype] != slot.dtype or tuple(tensor.shape) != shape:
            raise WeightsError(
                f"tensor '{where}' is {DTYPE_NAMES.get(tensor.dtype, tensor.dtype)} "
                f"{tuple(tensor.shape)}, the checkpoint has {slot.dtype} {shape}"
            )
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        with open(self.out / slot.file, "r+b") as f:
            f.seek(self.headers[slot.file] + slot.begin + (index or 0) * data.nbytes)
            f.write(data.tobytes())
        if index is None:
            self.written.add(name)
            return
        self.parts.setdefault(name, set()).add(index)
        if len(self.parts[name]) == slot.shape[0]:
            self.written.add(name)

    def close(self) -> list[Path]:
        missing = sorted(set(self.slots) - self.written)
        if missing:
            raise WeightsError(f"{len(missing)} tensor(s) were never written, e.g. {missing[0]}")
        return sorted(self.out / f for f in self.headers)


def _greedy_shards(
    tensors: dict[str, tuple[str, tuple[int, ...]]], max_bytes: int
) -> dict[str, list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = DTYPE_BYTES[dtype] * math.prod(shape)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    n = len(shards)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": names for i, names in enumerate(shards)}


def _layout(reader: SafetensorsReader) -> tuple[dict[str, tuple[str, tuple[int, ...]]],
                                                dict[str, list[str]] | None]:  # fmt: skip
    """(dtype and shape of every tensor of the original checkpoint in file order, its shard
    groups when it is sharded), read from the safetensors headers."""
    from safetensors import safe_open

    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    groups: dict[str, list[str]] = {}
    for shard in sorted(set(reader.files.values())):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is no dict
                piece = f.get_slice(name)
                tensors[name] = (piece.get_dtype(), tuple(piece.get_shape()))
                groups.setdefault(shard.name, []).append(name)
    sharded = (reader.path / "model.safetensors.index.json").is_file()
    return tensors, groups if sharded else None


def _fused_shapes(
    like: HFModel, rules: Iterable, reader: SafetensorsReader,
    layout: dict[str, tuple[str, tuple[int, ...]]],
) -> dict[str, tuple[str, tuple[int, ...]]]:  # fmt: skip
    """The shape each fused tensor (one several rules write slices of) is written in: its
    slices as the rules write them (Qwen3-VL-MoE's experts in the hub's orientation, whatever
    orientation `like` holds), found by running the rules on empty (meta) tensors."""
    shapes = canonical_shapes(like)
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for rule in rules:
        names = [split_slice(n) for n in rule.hf]
        if all(index is None for _, index in names):
            continue
        pieces = rule.to_hf(torch.empty(shapes[rule.canonical], device="meta"))
        for (name, _), piece in zip(names, pieces, strict=True):
            file_name = to_file_name(name, reader.style)
            dtype, stored = layout[file_name]
            out[file_name] = (dtype, (stored[0], *piece.shape))
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
    layout, shard_groups = _layout(reader)
    layout.update(_fused_shapes(like, rules.values(), reader, layout))
    if dtype is not None:
        layout = {n: (DTYPE_NAMES[dtype], shape) for n, (_, shape) in layout.items()}
    writer = ShardWriter(out, layout, shard_groups, max_shard_bytes)
    originals = {n: DTYPES[d] for n, (d, _) in layout.items()}
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
                writer.add(file_name, piece.to(originals[split_slice(file_name)[0]]))
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
        writer.add(file_name, tensor.to(originals[file_name]))
    shards = writer.close()
    for f in sorted(like.path.iterdir()):
        weights = f.name.endswith(WEIGHT_SUFFIXES) or f.name in WEIGHT_INDEXES
        if f.is_file() and not weights:
            shutil.copy2(f, out / f.name)
    return shards
