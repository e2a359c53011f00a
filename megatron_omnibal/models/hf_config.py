"""Read a Hugging Face checkpoint directory's config.json into a ModelSpec.

Why here and not in each command: `omnibal plan/stats/convert --model HF_DIR` and the Megatron
entry point must agree on the architecture, and every field the stage module builds (norms,
biases, layer scale, QK-norm, feature layer, tied head, RoPE base) must come from the checkpoint
itself, never from a guess. Families:

- transformers' `internvl` (InternVLForConditionalGeneration) and `llava`
  (LlavaForConditionalGeneration): parsed with transformers' own config classes (defaults,
  renamed fields and RoPE parameters as transformers applies them).
- OpenGVLab's remote-code `internvl_chat` (what most InternVL checkpoints on disk are): its
  JSON is read directly (no remote code runs); its LLM is InternLM2, Qwen2/2.5, Qwen3 or Llama.
- transformers' `qwen2_5_vl` (Qwen2_5_VLForConditionalGeneration): the native-resolution
  vision tower, the patch merger and a Qwen2 LLM with M-RoPE; the hub's flat config.json (text
  keys at the top level, `rope_scaling` of type mrope) and the re-saved one (`text_config`)
  both, through transformers' own Qwen2_5_VLConfig.

LLMs: Llama 2/3.x (Llama-3 RoPE scaling with megatron-core's fixed frequency bands), Mistral,
Qwen2/2.5 (qkv bias), Qwen3 (per-head QK-norm, its own head size, no biases), InternLM2.
Anything the stage module cannot build exactly (another RoPE scaling, several feature layers,
a mixture-of-experts or unknown LLM, a model type planned but not built yet) is an error that
names the field, never an approximation.

Each family's reader is in its folder (models/families/<family>/config.py), found through the
registry by config.json's `model_type`; what they share (the LLM part, tokenizer files, the
error type) is models/families/shared/config.py.
"""

from __future__ import annotations

from pathlib import Path

from megatron_omnibal.models.families.registry import BY_NAME
from megatron_omnibal.models.families.shared.config import HFConfigError, HFModel, load_json
from megatron_omnibal.models.spec import ModelSpec

__all__ = ["HFConfigError", "HFModel", "read_hf", "spec_from_hf"]

# Model types recognised but not built yet: read_hf refuses them with the reason.
NOT_YET = {
    "qwen2_vl": "Qwen2-VL's vision tower (full attention in every block, LayerNorm, a plain "
    "MLP) is not the Qwen2.5-VL tower the stage module builds",
}


def read_hf(path: str | Path) -> HFModel:
    """The model in checkpoint directory `path` (its config.json; tokenizer files for the
    image token ids where the config does not hold them)."""
    path = Path(path)
    doc = load_json(path / "config.json")
    kind = doc.get("model_type")
    if kind in NOT_YET:
        raise HFConfigError(
            f"{path / 'config.json'}: model_type {kind!r} is not supported yet: {NOT_YET[kind]} "
            f"(supported: {', '.join(BY_NAME)})"
        )
    if kind not in BY_NAME:
        raise HFConfigError(
            f"{path / 'config.json'}: model_type {kind!r} is not supported "
            f"(supported: {', '.join(BY_NAME)})"
        )
    return BY_NAME[kind].read_config(path, doc)


def spec_from_hf(path: str | Path) -> ModelSpec:
    """The ModelSpec of a Hugging Face checkpoint directory."""
    return read_hf(path).spec
