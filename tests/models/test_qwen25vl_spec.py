"""Qwen2.5-VL's model spec: the presets against hand counts of the released checkpoints' shapes,
the fields validated by name, and both config.json layouts (the hub's flat one, transformers'
re-saved `text_config` one) read to the same spec through transformers' Qwen2_5_VLConfig."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_omnibal.models.hf_config import HFConfigError, read_hf
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.models.spec import ModelSpec, SpecError

TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 152064,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 4096}  # fmt: skip
VISION = {"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 4,
          "out_hidden_size": 64, "fullatt_block_indexes": [1, 3], "window_size": 56,
          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
          "hidden_act": "silu", "in_chans": 3, "tokens_per_second": 2}  # fmt: skip
IDS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
       "vision_end_token_id": 151653}  # fmt: skip


def test_presets_match_hand_counts() -> None:
    seven, big = get_preset("qwen2.5-vl-7b"), get_preset("qwen2.5-vl-72b")
    v = seven.vit
    assert big.vit == v and v.native_resolution and v.rope_theta == 1e4 and v.gated_mlp
    assert (v.num_layers, v.hidden_size, v.ffn_hidden_size, v.num_attention_heads) == (
        32, 1280, 3420, 16)  # fmt: skip
    assert (v.patch_size, v.temporal_patch_size, v.spatial_merge_size) == (14, 2, 2)
    assert v.window_size == 112 and v.window_patches == 8
    assert v.fullatt_block_indexes == (7, 15, 23, 31)
    # One tile = one 2x2 merge group of 14 px patches = 28 px = one LLM token.
    assert v.image_size == 28 and v.num_patches == 4 and seven.tokens_per_tile == 1
    # Block: qkv 1280x3840 + bias, proj 1280^2 + bias, SwiGLU 3 x 1280x3420 + biases, 2 norms.
    block = 1280 * 3840 + 3840 + 1280 * 1280 + 1280 + 3 * 1280 * 3420 + 2 * 3420 + 1280 + 2 * 1280
    assert v.layer_params == block
    assert seven.patch_embed_params == 3 * 2 * 14 * 14 * 1280  # Conv3d, no bias, no positions
    # Merger: RMSNorm(1280), Linear(5120, 5120) + bias, Linear(5120, out) + bias.
    assert seven.projector_params == 1280 + 5120 * 5120 + 5120 + 5120 * 3584 + 3584
    assert big.projector_params == 1280 + 5120 * 5120 + 5120 + 5120 * 8192 + 8192
    vision = v.num_layers * v.layer_params + seven.patch_embed_params + seven.projector_params
    assert 0.67e9 < vision < 0.68e9  # Qwen2.5-VL-7B's `visual` is about 0.676B parameters
    assert seven.llm.mrope_section == (16, 24, 24) and seven.llm.kv_channels == 128
    assert (big.llm.num_layers, big.llm.hidden_size, big.llm.num_query_groups) == (80, 8192, 8)
    assert (seven.image_token_id, seven.image_start_id, seven.image_end_id) == (
        151655, 151652, 151653)  # fmt: skip


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"vit": {"fullatt_block_indexes": [7, 40]}}, "model_spec.vit.fullatt_block_indexes"),
        ({"vit": {"fullatt_block_indexes": [15, 7]}}, "must be ascending"),
        ({"vit": {"fullatt_block_indexes": 7}}, "expected a list of integers"),
        ({"vit": {"window_size": 100}}, "model_spec.vit.window_size: 100 is not 0 or a multiple"),
        ({"vit": {"image_size": 56}}, "a native-resolution tile is one merge group of 28 px"),
        ({"projector": {"type": "pixel_shuffle_mlp"}}, "needs a patch_merger projector"),
        ({"llm": {"mrope_section": [16, 24, 23]}}, "model_spec.llm.mrope_section"),
    ],
)
def test_bad_fields_are_named(edit: dict, message: str) -> None:
    doc = get_preset("qwen2.5-vl-7b").to_dict()
    for part, fields in edit.items():
        doc[part] = {**doc[part], **fields}
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_dict(json.loads(json.dumps(doc)))


def _write(path: Path, doc: dict) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(doc))
    return path


def test_flat_and_nested_configs_read_alike(tmp_path: Path) -> None:
    from transformers import Qwen2_5_VLConfig

    flat = _write(tmp_path / "flat", {
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        **TEXT, "rope_theta": 1e6, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        **IDS, "tie_word_embeddings": False, "vision_config": VISION})  # fmt: skip
    nested = tmp_path / "nested"
    Qwen2_5_VLConfig(
        text_config={**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                 "mrope_section": [2, 3, 3]}},
        vision_config=VISION, **IDS,
    ).save_pretrained(nested)  # fmt: skip
    assert "text_config" in json.loads((nested / "config.json").read_text())
    a, b = read_hf(flat), read_hf(nested)
    assert a.spec == b.spec and a.family == b.family == "qwen2_5_vl" and a.llm_arch == "qwen2"
    spec = a.spec
    assert spec.vit.fullatt_block_indexes == (1, 3) and spec.vit.window_size == 56
    assert spec.vit.num_layers == a.vit_checkpoint_layers == 4
    assert spec.projector.type == "patch_merger" and spec.projector_in == 128
    assert spec.projector.hidden_size == 128 and spec.llm.hidden_size == 64
    assert spec.llm.mrope_section == (2, 3, 3) and spec.llm.qkv_bias
    assert spec.llm.rotary_base == 1e6 and spec.llm.max_position_embeddings == 4096
    assert (spec.image_token_id, spec.image_start_id, spec.image_end_id) == (
        151655, 151652, 151653)  # fmt: skip
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_released_config_reads_as_the_preset(tmp_path: Path) -> None:
    """Qwen2.5-VL-7B-Instruct's hub config.json (flat, rope_scaling of type mrope) reads to the
    preset itself: the tower and merger the stage module builds from either are the same."""
    vision = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
              "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
              "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
              "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
              "temporal_patch_size": 2}  # fmt: skip
    path = _write(tmp_path / "Qwen2.5-VL-7B-Instruct", {
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
        "max_position_embeddings": 128000, "max_window_layers": 28, "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "sliding_window": 32768, "use_sliding_window": False,
        "tie_word_embeddings": False, "vocab_size": 152064, **IDS, "vision_config": vision,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}})  # fmt: skip
    read, preset = read_hf(path).spec, get_preset("qwen2.5-vl-7b")
    assert (read.vit, read.projector, read.llm) == (preset.vit, preset.projector, preset.llm)
    assert (read.image_token_id, read.image_start_id, read.image_end_id) == (
        preset.image_token_id, preset.image_start_id, preset.image_end_id)  # fmt: skip


@pytest.mark.parametrize(
    "model_type, message",
    [
        ("qwen2_vl", "'qwen2_vl' is not supported yet: Qwen2-VL's vision tower"),
    ],
)
def test_other_qwen_vl_families_are_refused(tmp_path: Path, model_type: str,
                                            message: str) -> None:
    path = _write(tmp_path / model_type, {"model_type": model_type})
    with pytest.raises(HFConfigError, match=message):
        read_hf(path)


def test_mismatched_merger_width_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad", {
        "model_type": "qwen2_5_vl", **TEXT, "rope_scaling": {"type": "mrope",
                                                             "mrope_section": [2, 3, 3]},
        **IDS, "vision_config": {**VISION, "out_hidden_size": 96}})  # fmt: skip
    with pytest.raises(HFConfigError, match="out_hidden_size 96 differs from the LLM's hidden"):
        read_hf(path)
