"""Qwen3-VL's config.json in both layouts a user meets, into the spec the stages build:

- the hub's (Qwen/Qwen3-VL-8B-Instruct's and -2B's shapes: `text_config.rope_scaling` with
  mrope_interleaved and mrope_section beside rope_theta, `vision_config.model_type` qwen3_vl)
  reads to the presets qwen3-vl-8b and -2b (written from the released configs);
- transformers 5's own save (`rope_parameters`) of the tiny test model reads to its spec;
- what the stages do not build is refused naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_omnibal.models.hf_config import HFConfigError, read_hf
from megatron_omnibal.models.presets import get_preset
from megatron_omnibal.models.spec import ModelSpec
from tests.helpers import qwen3_vl


def hub_config(big: bool = True) -> dict:
    """config.json as Qwen/Qwen3-VL-8B-Instruct (big) or -2B-Instruct lays it out."""
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "dtype": "bfloat16", "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096 if big else 2048, "initializer_range": 0.02,
        "intermediate_size": 12288 if big else 6144, "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text", "num_attention_heads": 32 if big else 16,
        "num_hidden_layers": 36 if big else 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                         "rope_type": "default"},
        "rope_theta": 5000000, "tie_word_embeddings": not big, "use_cache": True,
        "vocab_size": 151936,
    }
    vision = {
        "deepstack_visual_indexes": [8, 16, 24] if big else [5, 11, 17],
        "depth": 27 if big else 24, "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152 if big else 1024, "in_channels": 3, "initializer_range": 0.02,
        "intermediate_size": 4304 if big else 4096, "model_type": "qwen3_vl", "num_heads": 16,
        "num_position_embeddings": 2304, "out_hidden_size": text["hidden_size"],
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
    }
    return {"architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655,
            "model_type": "qwen3_vl", "text_config": text, "tie_word_embeddings": not big,
            "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
            "vision_config": vision, "vision_end_token_id": 151653,
            "vision_start_token_id": 151652}  # fmt: skip


def _write(path: Path, doc: dict) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("big, preset", [(True, "qwen3-vl-8b"), (False, "qwen3-vl-2b")])
def test_the_hubs_layout_reads_to_the_released_shapes(tmp_path: Path, big: bool,
                                                      preset: str) -> None:
    model = read_hf(_write(tmp_path / preset, hub_config(big)))
    read, want = model.spec, get_preset(preset)
    assert (model.family, model.llm_arch, model.vit_checkpoint_layers) == (
        "qwen3_vl", "qwen3", want.vit.num_layers)  # fmt: skip
    assert (read.vit, read.projector, read.llm) == (want.vit, want.projector, want.llm)
    assert (read.image_token_id, read.image_start_id, read.image_end_id) == (
        151655, 151652, 151653)  # fmt: skip


def test_transformers_5s_own_save_reads_to_the_models_spec(tmp_path: Path) -> None:
    qwen3_vl.hf_config().save_pretrained(tmp_path)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())["text_config"]
    read, want = read_hf(tmp_path).spec, ModelSpec.from_dict(qwen3_vl.SPEC)
    assert (read.vit, read.projector, read.llm) == (want.vit, want.projector, want.llm)
    assert read.image_token_id == qwen3_vl.IMAGE_TOKEN


def _rope(**kw: object):  # noqa: ANN202
    def edit(d: dict) -> None:
        d["text_config"]["rope_scaling"].update(kw)
    return edit


@pytest.mark.parametrize(
    "edit, message",
    [
        (_rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=262144),
         "rope_type 'yarn': Qwen3-VL's stage module builds only 'default'"),
        (_rope(mrope_interleaved=False), "mrope_interleaved False: Qwen3-VL's M-RoPE is inter"),
        (_rope(mrope_section=[24, 20, 16]), r"mrope_section \[24, 20, 16\]: the sections must "
                                             "sum to the head's 64"),
        (_rope(mrope_section=[4, 30, 30]), r"mrope_section \[4, 30, 30\]"),
        (lambda d: d["vision_config"].update(deepstack_visual_indexes=[8, 16, 27]),
         r"vision_config.deepstack_visual_indexes \[8, 16, 27\]: must be distinct layers of "
         "the tower's 27"),
        (lambda d: d["vision_config"].update(deepstack_visual_indexes=[8, 8]),
         "deepstack_visual_indexes .8, 8.: must be distinct"),
        (lambda d: d["vision_config"].update(out_hidden_size=2048),
         "vision_config.out_hidden_size 2048 differs from the LLM's hidden size"),
        (lambda d: d["vision_config"].update(hidden_act="gelu"),
         "vision_config.hidden_act 'gelu': only gelu_pytorch_tanh"),
        (lambda d: d["vision_config"].update(num_position_embeddings=2300),
         "vision_config.num_position_embeddings 2300: not a square table"),
        (lambda d: d["text_config"].update(attention_bias=True), "attention_bias=true"),
        (lambda d: d["text_config"].update(model_type="qwen3_vl_moe_text"),
         "text_config.model_type 'qwen3_vl_moe_text': expected qwen3_vl_text"),
    ],
)
def test_what_the_stages_do_not_build_is_refused_naming_the_key(tmp_path: Path, edit,
                                                                message: str) -> None:
    doc = hub_config()
    edit(doc)
    with pytest.raises(HFConfigError, match=message):
        read_hf(_write(tmp_path / "m", doc))
