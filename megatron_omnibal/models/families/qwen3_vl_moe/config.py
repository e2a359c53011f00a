"""transformers' `qwen3_vl_moe` config.json (Qwen3VLMoeForConditionalGeneration) -> its
ModelSpec: Qwen3-VL's tower and interleaved M-RoPE (the qwen3_vl family's readers) with a
Qwen3-MoE LLM.

Its router always renormalises the picked probabilities (transformers' Qwen3VLMoeTextTopKRouter
has no `norm_topk_prob`), so the spec says so whatever the config holds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megatron_omnibal.models.families.qwen3_vl.config import (
    interleaved_mrope,
    read_vision,
    tokens,
)
from megatron_omnibal.models.families.shared.config import (
    HFModel,
    checked_towers,
    config_value,
    language,
)
from megatron_omnibal.models.spec import ModelSpec


def read_config(path: Path, doc: dict) -> HFModel:
    cfg, vc, tc = checked_towers(path, "text", "qwen3_vl_moe_text",
                                 "expected qwen3_vl_moe_text (a Qwen3-MoE LLM)")  # fmt: skip
    head_dim = int(config_value(tc, "head_dim") or 0) or (
        int(config_value(tc, "hidden_size")) // int(config_value(tc, "num_attention_heads")))
    section = interleaved_mrope(path, tc, head_dim)  # the RoPE checked before the LLM
    llm = replace(language(tc, "qwen3_moe", path), mrope_section=section,
                  mrope_interleaved=True, moe_norm_topk_prob=True,
                  tie_embeddings=bool(cfg.tie_word_embeddings))  # fmt: skip
    vit, projector = read_vision(path, vc, llm.hidden_size, llm.num_layers)
    spec = ModelSpec(name=path.name, vit=vit, projector=projector, llm=llm, **tokens(cfg),
                     source=str(path))  # fmt: skip
    return HFModel(path, spec, "qwen3_vl_moe", "qwen3_moe", vit.num_layers)
