"""The one model spec: validation that names the field, the JSON round trip of plan.json's
model_spec, and derived sizes checked against hand counts."""

from __future__ import annotations

import json

import pytest

from megatron_omnibal.models.presets import PRESETS, get_preset
from megatron_omnibal.models.resolve import resolve_model
from megatron_omnibal.models.spec import ModelSpec, SpecError


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_json(name: str) -> None:
    spec = PRESETS[name]
    doc = json.loads(json.dumps(spec.to_dict()))
    assert ModelSpec.from_dict(doc) == spec


def test_derived_fields() -> None:
    six = get_preset("internvl-6b-20b")
    assert six.tokens_per_tile == 256 and six.image_token_id == 92552  # (448/14/2)^2; last id
    assert six.projector.hidden_size == 6144 and six.projector_in == 12800
    assert six.llm.kv_size == 8 * 128 and six.vit.seq_per_tile == 1025
    llava = get_preset("llava-1.5-7b")
    assert llava.tokens_per_tile == 576 and llava.image_token_id == 32000
    doc = llava.to_dict()
    full = ModelSpec.from_dict(
        {**doc, "vit": {**doc["vit"], "drop_class_token": False}, "tokens_per_tile": 0}
    )
    assert full.tokens_per_tile == 577  # "full" feature select keeps the class token
    tiny_mlp = ModelSpec.from_dict(
        {**PRESETS["tiny"].to_dict(), "projector": {"type": "mlp", "hidden_size": 8},
         "tokens_per_tile": 0}
    )  # fmt: skip
    assert tiny_mlp.tokens_per_tile == 16  # (16 / 4)^2 patches, no pixel shuffle


def test_layer_params_match_hand_counts() -> None:
    six = get_preset("internvl-6b-20b")
    h, f = 3200, 12800
    # qkv (no bias), proj + bias, fc1 + fc2 + biases, 2 RMSNorms, QK-norms, 2 layer scales
    assert six.vit.layer_params == 4 * h * h + h + 2 * h * f + f + h + 2 * h + 2 * h + 2 * h
    qwen = ModelSpec.from_dict(
        {**six.to_dict(), "llm": {**six.to_dict()["llm"], "qkv_bias": True}}
    )
    assert qwen.llm.layer_params - six.llm.layer_params == 6144 + 2 * 1024


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["llm"].update(num_layerz=3), r"model_spec.llm: unknown field 'num_layerz'"),
        (lambda d: d["vit"].pop("patch_size"), r"model_spec.vit: missing field\(s\) patch_size"),
        (lambda d: d["vit"].update(norm="batchnorm"), r"model_spec.vit.norm: 'batchnorm'"),
        (lambda d: d["llm"].update(num_query_groups=5), r"llm.num_query_groups: 5 does not"),
        (lambda d: d.update(tokens_per_tile=1024), r"tokens_per_tile: 1024.*gives 256"),
        (lambda d: d["vit"].update(qk_norm="yes"), r"model_spec.vit.qk_norm: expected true"),
        (lambda d: d["projector"].update(downsample=0.3), r"projector.downsample: 0.3 must be"),
        (lambda d: d.update(image_token_id=10**6), r"image_token_id: 1000000 is outside"),
        (lambda d: d.pop("llm"), r"model_spec: missing section 'llm'"),
    ],
)
def test_bad_specs_name_the_field(edit, message: str) -> None:
    doc = json.loads(json.dumps(get_preset("internvl-6b-20b").to_dict()))
    edit(doc)
    with pytest.raises(SpecError, match=message):
        ModelSpec.from_dict(doc)


def test_resolve_preset_file_and_unknown(tmp_path) -> None:
    path = tmp_path / "m.yaml"
    import yaml

    path.write_text(yaml.safe_dump(get_preset("tiny").to_dict()))
    assert resolve_model(path) == get_preset("tiny")
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'.*internvl-6b-20b"):
        resolve_model("gpt5")
