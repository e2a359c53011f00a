"""Hugging Face checkpoint -> Megatron checkpoint of the VLM stages, one pipeline stage at a time.

Why streaming: a 26B checkpoint does not fit the converting machine's memory twice over. The
HF tensors of one stage are read (models.hf_weights, tensor by tensor), turned into canonical
tensors, cut into each TP rank's piece (megatron.tp_shard; a mixture-of-experts layer's experts also
over the expert-parallel ranks) and written as that rank's file of Megatron's `torch` format
(`release/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`, the layout
megatron.training's load_checkpoint reads, `_extra_state` entries included); then the next
stage. Peak memory is one stage's tensors.

The checkpoint records the model spec and the layout it was written for (`omnibal_model.json`),
so the export and the training entry point can check they read it with the same ones.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from megatron_omnibal.megatron.checkpoint.stage_weights import source, stage_names, stage_state_dict
from megatron_omnibal.megatron.stages.layout import rank_stages
from megatron_omnibal.models.hf_config import HFModel
from megatron_omnibal.models.hf_weights import SafetensorsReader, canonical_tensors, rules_for
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "omnibal_model.json"
CHECKPOINT_VERSION = 3.0  # megatron.training's current torch-format version


def rank_dir(
    root: Path, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1
) -> Path:
    """megatron.training's directory of one model-parallel rank's file (`_EEE`: the
    expert-parallel rank, under EP > 1)."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return root / (name if ep_size == 1 else f"{name}_{ep_rank:03d}")


def write_torch_checkpoint(
    hf: HFModel,
    layouts: Sequence[StageLayout],
    tp: int,
    out: Path,
    dtype: torch.dtype | None = None,
    progress: Callable[[int], None] | None = None,
    pp: int | None = None,
    ep: int = 1,
) -> list[Path]:
    """Write `hf` as a `torch`-format Megatron checkpoint for `layouts` at TP `tp` (iteration
    'release', as Megatron-LM's converters do). Returns the files written. `progress` is called
    with the number of canonical tensors done after each pipeline rank. With `pp` ranks fewer
    than the layouts (virtual stages: interleaved 1F1B) each rank's file holds its chunks
    under `model0`, `model1`, ... as megatron.training saves them; peak memory is one rank's
    tensors. With `ep` expert-parallel ranks each (TP, PP) rank has `ep` files, each with the
    dense tensors and its own experts (megatron.training's `mp_rank_TT[_PPP]_EEE`)."""
    spec = hf.spec
    reader = SafetensorsReader(hf)
    order = [r.canonical for r in rules_for(hf)]
    release = out / "release"
    pp = pp or len(layouts)
    chunked = len(layouts) > pp
    written = []
    for rank in range(pp):
        virtual = rank_stages(len(layouts), pp, rank)
        names = [stage_names(spec, layouts[v], order) for v in virtual]
        wanted = {source(n, spec) for chunk in names for n in chunk}
        tensors = dict(canonical_tensors(hf, reader, wanted.__contains__))
        for r, e in ((r, e) for r in range(tp) for e in range(ep)):
            state = {}
            for c, (v, chunk) in enumerate(zip(virtual, names, strict=True)):
                model = stage_state_dict(
                    spec, layouts[v], {n: tensors[source(n, spec)] for n in chunk}, tp, r, ep, e
                )
                if dtype is not None:
                    model = {k: t if t is None else t.to(dtype) for k, t in model.items()}
                state[f"model{c}" if chunked else "model"] = model
            path = rank_dir(release, r, rank, pp, e, ep) / "model_optim_rng.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({**state, "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0}, path)
            written.append(path)
            del state
        if progress is not None:
            progress(sum(len(chunk) for chunk in names))
        del tensors
    (out / TRACKER).write_text("release")
    record = {
        "model_spec": spec.to_dict(),
        "tensor_parallel": tp,
        "pipeline_parallel": pp,
        "expert_parallel": ep,
        "stages": [st.to_dict() for st in layouts],
        "hf_source": str(hf.path),
        "family": hf.family,
        "llm_arch": hf.llm_arch,
    }
    (out / MODEL_FILE).write_text(json.dumps(record, indent=2))
    return written
