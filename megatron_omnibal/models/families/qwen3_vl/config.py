"""transformers' `qwen3_vl` config.json (Qwen3VLForConditionalGeneration) -> its ModelSpec.

Both layouts a user meets are read through transformers' own Qwen3VLConfig: as transformers 5
saves it (`text_config.rope_parameters` with `mrope_section` and `mrope_interleaved`) and as the
hub's checkpoints are laid out (`text_config.rope_scaling` {rope_type default, mrope_interleaved,
mrope_section} beside `rope_theta`, `vision_config.model_type` "qwen3_vl"); transformers
standardises the second into the first. What the stage module does not build is refused naming
the key, before any process starts.

Split so that a variant with the same tower and another LLM (Qwen3-VL-MoE) calls the parts:
`read_vision` (the tower, its merger and DeepStack taps), `interleaved_mrope` (the RoPE checks
and sections any Qwen3-VL text config shares), `tokens` (the vision token ids); `read_text` is
the dense LLM.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from megatron_omnibal.models.families.shared.config import (
    HFModel,
    checked_towers,
    config_value,
    language,
    need,
)
from megatron_omnibal.models.families.shared.qwen_native import native_tower
from megatron_omnibal.models.presets import QWEN3_VL_VIT_L
from megatron_omnibal.models.spec import LanguageSpec, ModelSpec, ProjectorSpec, VisionSpec


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_vision(path: Path, vc: Any, llm_hidden: int, llm_layers: int
                ) -> tuple[VisionSpec, ProjectorSpec]:
    """The tower and its merger from `vision_config` (a transformers Qwen3VLVisionConfig):
    learned positions plus 2-D RoPE, full attention, LayerNorms, a GELU-tanh MLP, DeepStack
    taps after the `deepstack_visual_indexes` layers fed to LLM layers 0, 1, ..."""
    where = "vision_config"
    for key in ("patch_size", "temporal_patch_size", "spatial_merge_size", "depth",
                "num_position_embeddings"):
        value = getattr(vc, key)
        need(_int(value) and value > 0, path,
             f"{where}.{key} {value!r}: expected a positive integer (square patches of one size)")
    need(int(vc.out_hidden_size) == llm_hidden, path,
         f"{where}.out_hidden_size {vc.out_hidden_size} differs from the LLM's hidden size "
         f"(text_config.hidden_size {llm_hidden})")
    need(vc.hidden_act == "gelu_pytorch_tanh", path,
         f"{where}.hidden_act {vc.hidden_act!r}: only gelu_pytorch_tanh (Qwen3-VL's) is built")
    need(int(getattr(vc, "in_channels", 3)) == 3, path,
         f"{where}.in_channels {vc.in_channels}: only RGB (3) is built")
    side = round(int(vc.num_position_embeddings) ** 0.5)
    need(side * side == int(vc.num_position_embeddings), path,
         f"{where}.num_position_embeddings {vc.num_position_embeddings}: not a square table")
    depth = int(vc.depth)
    taps = list(vc.deepstack_visual_indexes or ())
    need(all(_int(i) and 0 <= i < depth for i in taps) and len(set(taps)) == len(taps), path,
         f"{where}.deepstack_visual_indexes {taps}: must be distinct layers of the tower's "
         f"{depth} (0 to {depth - 1})")
    need(len(taps) <= llm_layers, path,
         f"{where}.deepstack_visual_indexes {taps}: {len(taps)} DeepStack features but the LLM "
         f"has {llm_layers} layers to add them after")
    params = getattr(vc, "rope_parameters", None) or {}
    merge = int(vc.spatial_merge_size)
    vit = native_tower(
        QWEN3_VL_VIT_L,
        vc,
        num_position_embeddings=int(vc.num_position_embeddings),
        deepstack_indexes=tuple(int(i) for i in taps),
        rope_theta=float(params.get("rope_theta", 1e4)),
    )
    # the merger: a LayerNorm of each patch, Linear(4 Cv, 4 Cv), exact GELU, Linear(4 Cv, LLM)
    merger = ProjectorSpec(type="patch_merger", downsample=1 / merge,
                           hidden_size=int(vc.hidden_size) * merge**2, norm_eps=1e-6,
                           merger_norm="layernorm")
    return vit, merger


def interleaved_mrope(path: Path, tc: Any, head_dim: int) -> tuple[int, ...]:
    """The M-RoPE sections of a Qwen3-VL `text_config` (any of its LLMs, dense or MoE), once
    its RoPE is what the stages build: plain (rope_type default), interleaved, sections that
    fit heads of `head_dim`."""
    params = config_value(tc, "rope_parameters")
    params = params if isinstance(params, dict) else {}
    kind = params.get("rope_type", params.get("type", "default"))
    need(kind == "default", path,
         f"text_config.rope_parameters.rope_type {kind!r}: Qwen3-VL's stage module builds only "
         "'default' RoPE with interleaved M-RoPE sections")
    interleaved = params.get("mrope_interleaved", True)
    need(interleaved is True, path,
         f"text_config.rope_parameters.mrope_interleaved {interleaved!r}: Qwen3-VL's M-RoPE is "
         "interleaved (transformers always interleaves it); contiguous sections are not built")
    section = params.get("mrope_section")
    need(isinstance(section, list | tuple) and len(section) == 3
         and all(_int(x) and x > 0 for x in section), path,
         f"text_config.rope_parameters.mrope_section {section!r}: expected 3 positive integers")
    pairs = head_dim // 2
    need(sum(section) == pairs and 3 * max(section[1], section[2]) <= pairs, path,
         f"text_config.rope_parameters.mrope_section {list(section)}: the sections must sum to "
         f"the head's {pairs} frequency pairs and the height and width ones fit every third "
         "of them")
    return tuple(int(x) for x in section)


def read_text(path: Path, tc: Any) -> LanguageSpec:
    """The dense Qwen3 LLM of `text_config` with Qwen3-VL's interleaved M-RoPE (the RoPE
    checked before the LLM, so a RoPE type the LLM reader would take is refused as Qwen3-VL's)."""
    head_dim = int(config_value(tc, "head_dim") or 0) or (
        int(config_value(tc, "hidden_size")) // int(config_value(tc, "num_attention_heads")))
    section = interleaved_mrope(path, tc, head_dim)
    llm = language(tc, "qwen3", path)
    return replace(llm, mrope_section=section, mrope_interleaved=True)


def tokens(cfg: Any) -> dict[str, int]:
    """The image placeholder and the vision start / end ids of the model's config."""
    return {"image_token_id": int(cfg.image_token_id),
            "image_start_id": int(cfg.vision_start_token_id),
            "image_end_id": int(cfg.vision_end_token_id)}  # fmt: skip


def read_config(path: Path, doc: dict) -> HFModel:
    """A dense Qwen3-VL (text_config.model_type qwen3_vl_text: a Qwen3 LLM)."""
    cfg, vc, tc = checked_towers(path, "text", "qwen3_vl_text",
                                 "expected qwen3_vl_text (a dense Qwen3 LLM)")
    llm = read_text(path, tc)
    vit, projector = read_vision(path, vc, llm.hidden_size, llm.num_layers)
    spec = ModelSpec(
        name=path.name,
        vit=vit,
        projector=projector,
        llm=replace(llm, tie_embeddings=bool(cfg.tie_word_embeddings)),
        **tokens(cfg),
        source=str(path),
    )
    return HFModel(path, spec, "qwen3_vl", "qwen3", vit.num_layers)
