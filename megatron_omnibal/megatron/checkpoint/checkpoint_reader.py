"""Read a Megatron checkpoint of the VLM stages back as canonical (model-wide, whole) tensors,
one group at a time, in one process.

Why not through Megatron's loader: exporting a trained 26B model must not need the training job's
GPUs or the whole model in memory. Both formats megatron.training writes are read directly:

- `torch`: one file per (TP, PP, EP) rank (`mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`): a
  stage's TP files are loaded, their local layer indices made global and their pieces joined
  (tp_shard.unshard); under EP each EP rank's file adds its experts (local indices made global);
- `torch_dist`: global tensors by key (a tower's layers stacked along a leading layer axis, a
  MoE layer's experts along a second one, the layer norms under Transformer Engine's names);
  each layer is loaded on its own.

The model spec and the stage layout come from the checkpoint itself: `omnibal_model.json`
(written by `omnibal convert`) or the `omnibal_model_spec` / `omnibal_stages` entries the
training entry point stores with Megatron's args.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_omnibal.megatron.checkpoint.hf_checkpoint import MODEL_FILE, TRACKER, rank_dir
from megatron_omnibal.megatron.checkpoint.stage_weights import (
    TIED_HEAD,
    expert_index,
    renumber_expert,
    to_global,
)
from megatron_omnibal.megatron.checkpoint.tp_shard import unshard
from megatron_omnibal.megatron.stages.layout import layout_from_dicts
from megatron_omnibal.models.lora import LoraSpec
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout

_TE_TO_LOCAL = (
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as the VLM stages; the message names file and why."""


@dataclass(frozen=True)
class Checkpoint:
    """One iteration of a Megatron checkpoint of the VLM stages."""

    path: Path  # the iteration directory (iter_NNNNNNN or release)
    format: str  # torch | torch_dist
    spec: ModelSpec
    layouts: tuple[StageLayout, ...]  # pp x vpp virtual stages with model chunks
    tp: int
    iteration: int
    pp: int  # pipeline ranks (fewer than the layouts with virtual stages)
    lora: LoraSpec | None = None  # a LoRA run's adapters (pretrain_vlm's --omnibal-lora-*)
    adapters_only: bool = False  # its checkpoints hold the adapters, not the base weights
    ep: int = 1  # expert-parallel ranks (torch format: EP files per TP x PP rank)


def _lora_from_args(saved: Any) -> tuple[LoraSpec | None, bool]:
    """The LoRA a checkpoint was trained with, and whether it holds the adapters only."""
    text = getattr(saved, "omnibal_lora", None)
    if text is None:
        return None, False
    return LoraSpec.from_dict(json.loads(text)), getattr(saved, "omnibal_lora_save", "full") \
        == "adapters"


def _iteration_dir(root: Path, iteration: int | None) -> tuple[Path, int]:
    if iteration is not None:
        return root / f"iter_{iteration:07d}", iteration
    tracker = root / TRACKER
    if not tracker.is_file():
        raise CheckpointError(f"{root}: no {TRACKER} (is this a Megatron checkpoint directory?)")
    text = tracker.read_text().strip()
    if text == "release":
        return root / "release", 0
    try:
        it = int(text)
    except ValueError:
        raise CheckpointError(
            f"{tracker}: expected an iteration or 'release', got {text!r}"
        ) from None
    return root / f"iter_{it:07d}", it


def _record(info: dict, where: str) -> tuple[ModelSpec, list[StageLayout]]:
    spec = ModelSpec.from_dict(info["model_spec"], f"{where}: model_spec")
    layouts = layout_from_dicts(
        info["stages"], spec.vit.num_layers, spec.llm.num_layers, f"{where}: stages"
    )
    return spec, layouts


def _from_args(saved: Any, where: str) -> tuple[ModelSpec, list[StageLayout], int, int, int]:
    """Model, layout, TP, PP and EP size from the argument namespace a checkpoint saved."""
    spec_text = getattr(saved, "omnibal_model_spec", None)
    stages_text = getattr(saved, "omnibal_stages", None)
    if spec_text is None or stages_text is None:
        raise CheckpointError(
            f"{where}: the checkpoint's args hold no omnibal_model_spec / omnibal_stages (not "
            "written by megatron_omnibal's pretrain_vlm or `omnibal convert`)"
        )
    spec, layouts = _record(
        {"model_spec": json.loads(spec_text), "stages": json.loads(stages_text)}, where
    )
    pp = int(getattr(saved, "pipeline_model_parallel_size", len(layouts)))
    ep = int(getattr(saved, "expert_model_parallel_size", 1) or 1)
    return spec, layouts, int(saved.tensor_model_parallel_size), pp, ep


def open_checkpoint(root: str | Path, iteration: int | None = None) -> Checkpoint:
    """The checkpoint at `root` (its latest iteration unless `iteration` is given)."""
    root = Path(root)
    path, it = _iteration_dir(root, iteration)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if (path / "metadata.json").is_file():
        fmt = "torch_dist"
    elif any(path.glob("mp_rank_*")):
        fmt = "torch"
    else:
        raise CheckpointError(f"{path}: neither a torch nor a torch_dist checkpoint")
    record = root / MODEL_FILE
    lora, adapters_only = None, False
    if record.is_file():
        info = json.loads(record.read_text())
        spec, layouts = _record(info, str(record))
        tp, pp = int(info["tensor_parallel"]), int(info.get("pipeline_parallel", len(layouts)))
        ep = int(info.get("expert_parallel", 1))
    elif fmt == "torch_dist":
        from megatron.core import dist_checkpointing

        common = dist_checkpointing.load_common_state_dict(str(path))
        spec, layouts, tp, pp, ep = _from_args(common.get("args"), str(path))
        lora, adapters_only = _lora_from_args(common.get("args"))
    else:
        first = next(iter(sorted(path.glob("mp_rank_*"))))
        state = torch.load(first / "model_optim_rng.pt", map_location="cpu", weights_only=False)
        spec, layouts, tp, pp, ep = _from_args(state.get("args"), str(first))
        lora, adapters_only = _lora_from_args(state.get("args"))
    if pp < 1 or len(layouts) % pp:
        raise CheckpointError(f"{path}: {len(layouts)} stages do not divide over PP {pp}")
    return Checkpoint(path, fmt, spec, tuple(layouts), tp, it, pp, lora, adapters_only, ep)


def _torch_stage(ckpt: Checkpoint, stage: int) -> dict[str, torch.Tensor]:
    """Virtual stage `stage`: model chunk stage // pp of rank stage % pp (with virtual stages
    a rank's file holds `model0`, `model1`, ...); under EP the dense tensors of EP rank 0's
    files, the experts of every EP rank's."""
    layout = ckpt.layouts[stage]
    key = "model" if len(ckpt.layouts) == ckpt.pp else f"model{stage // ckpt.pp}"
    per_rank = ckpt.spec.llm.num_experts // ckpt.ep
    parts: dict[str, list[torch.Tensor]] = {}
    for e, r in ((e, r) for e in range(ckpt.ep) for r in range(ckpt.tp)):
        f = rank_dir(ckpt.path, r, stage % ckpt.pp, ckpt.pp, e, ckpt.ep) / "model_optim_rng.pt"
        if not f.is_file():
            raise CheckpointError(
                f"{f}: missing (TP {ckpt.tp} x PP {ckpt.pp} x EP {ckpt.ep} files)"
            )
        state = torch.load(f, map_location="cpu", weights_only=False)
        model = state.get(key)
        if model is None:
            raise CheckpointError(
                f"{f}: no '{key}' state (the checkpoint's layout has {len(ckpt.layouts)} stages "
                f"over PP {ckpt.pp})"
            )
        for local, tensor in model.items():
            if local.endswith("._extra_state") or tensor is None:
                continue
            if e > 0 and expert_index(local) is None:
                continue  # EP rank 0's copy of what every EP rank holds
            name = renumber_expert(to_global(local, layout), e * per_rank)
            parts.setdefault(name, []).append(tensor)
    out = {}
    for name, pieces in parts.items():
        if name == TIED_HEAD and ckpt.spec.llm.tie_embeddings:
            continue  # the head's copy of the tied embedding
        if len(pieces) != ckpt.tp:
            raise CheckpointError(f"{ckpt.path}: {name} is on {len(pieces)} of {ckpt.tp} TP ranks")
        out[name] = unshard(name, pieces, ckpt.spec)
    return out


_STACKED = re.compile(r"^(vit|llm)\.layers\.(.+)$")
# megatron-core's SequentialMLP stacks a layer's experts under one key, along axis 1.
_EXPERTS = "mlp.experts.experts."


class _DistChunks:
    """The tensor chunks of a torch_dist checkpoint, read straight from its files: a chunk is
    one rank's piece of one ShardedTensor (a layer's TP shard), stored as torch.save bytes at
    an offset that the checkpoint's metadata records. Reading by chunk keeps memory at one layer
    of one tensor, in one process, with no process group."""

    def __init__(self, path: Path) -> None:
        from torch.distributed.checkpoint import FileSystemReader

        self.path = path
        self.metadata = FileSystemReader(str(path)).read_metadata()

    def tensors(self) -> list[tuple[str, Any]]:
        """(key, tensor metadata) of the model's tensors (no optimizer state, no objects)."""
        return [
            (k, m)
            for k, m in sorted(self.metadata.state_dict_metadata.items())
            if hasattr(m, "chunks") and not k.startswith("optimizer")
        ]

    def read(self, key: str, meta: Any, first: int | None) -> torch.Tensor:
        """The whole tensor `key`, or its slice `first` along the stacked layer axis."""
        import io

        from torch.distributed.checkpoint.metadata import MetadataIndex

        size = list(meta.size)
        lo, hi = (0, size[0]) if first is None else (first, first + 1)
        out = torch.empty([hi - lo, *size[1:]], dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            begin, end = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
            if end <= lo or begin >= hi:
                continue
            info = self.metadata.storage_data[MetadataIndex(key, chunk.offsets)]
            if info.transform_descriptors:
                raise CheckpointError(f"{self.path}: {key}: stored with transforms "
                                      f"{info.transform_descriptors}, which this reader lacks")
            with open(self.path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                data = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
            a, b = max(begin, lo), min(end, hi)
            target = [slice(a - lo, b - lo)] + [
                slice(o, o + n) for o, n in zip(chunk.offsets[1:], chunk.sizes[1:], strict=True)
            ]
            out[tuple(target)] = data[a - begin : b - begin]
            covered += (b - a) * math.prod(chunk.sizes[1:])
        if covered != out.numel():
            raise CheckpointError(f"{self.path}: {key}: the stored chunks do not cover the tensor")
        return out if first is None else out[0]


def _canonical_suffix(suffix: str) -> str:
    for te, local in _TE_TO_LOCAL:
        if suffix.startswith(te):
            return local + suffix[len(te) :]
    return suffix


def _dist_tensors(ckpt: Checkpoint) -> Iterator[tuple[str, torch.Tensor]]:
    chunks = _DistChunks(ckpt.path)
    for key, meta in chunks.tensors():
        m = _STACKED.match(key)
        if not m:
            name = _canonical_suffix(key)
            yield name, unshard(name, [chunks.read(key, meta, None)], ckpt.spec)
            continue
        for i in range(meta.size[0]):
            name = f"{m.group(1)}.layers.{i}.{_canonical_suffix(m.group(2))}"
            layer = chunks.read(key, meta, i)
            if not m.group(2).startswith(_EXPERTS):
                yield name, unshard(name, [layer], ckpt.spec)
                continue
            rest = m.group(2)[len(_EXPERTS) :]
            for e, tensor in enumerate(layer):
                name = f"{m.group(1)}.layers.{i}.mlp.experts.local_experts.{e}.{rest}"
                yield name, unshard(name, [tensor], ckpt.spec)


def canonical_groups(ckpt: Checkpoint) -> Iterator[dict[str, torch.Tensor]]:
    """The checkpoint's canonical tensors, a pipeline stage (torch) or a tensor (torch_dist) at
    a time, so memory holds one stage at most."""
    if ckpt.format == "torch":
        for stage in range(len(ckpt.layouts)):
            yield _torch_stage(ckpt, stage)
    else:
        for name, tensor in _dist_tensors(ckpt):
            yield {name: tensor}
