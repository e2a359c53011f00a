"""Mixture-of-experts LLMs read from Hugging Face checkpoints (InternVL3.5-30B-A3B's Qwen3-MoE in
transformers' `internvl` layout and OpenGVLab's `internvl_chat` one; Qwen3-VL-30B-A3B's
`qwen3_vl_moe`): the spec's expert fields come from the checkpoint's config (checked against the
config objects the tiny models were built from), the expert tensors map both ways (one per
expert; fused, in either orientation), and what is not built is refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_omnibal.models.families.shared.weights import language_rules
from megatron_omnibal.models.hf_config import HFConfigError, read_hf
from megatron_omnibal.models.hf_weights import SafetensorsReader, canonical_shapes
from tests.helpers import hf_models


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {
        "internvl": hf_models.internvl(root / "internvl", six_b=False, text="qwen3_moe",
                                       llm_layers=2).path,
        "chat": hf_models.internvl_chat(root / "chat", text="qwen3_moe", six_b=False,
                                        llm_layers=2).path,
        "qwen3_vl_moe": hf_models.qwen3_vl_moe(root / "qwen3_vl_moe").path,
    }  # fmt: skip


@pytest.mark.parametrize("layout", ["internvl", "chat", "qwen3_vl_moe"])
def test_experts_come_from_the_config(built, layout: str) -> None:
    hf = read_hf(built[layout])
    llm, want = hf.spec.llm, hf_models.MOE_TEXT
    assert hf.llm_arch == "qwen3_moe" and llm.qk_norm and llm.kv_channels == 16
    assert (llm.num_experts, llm.moe_top_k, llm.moe_ffn_hidden_size) == (
        want["num_experts"], want["num_experts_per_tok"], want["moe_intermediate_size"])
    assert llm.moe_norm_topk_prob is want["norm_topk_prob"]
    # router_aux_loss_coef is megatron-core's per-layer coefficient as it is (docs/models.md)
    assert llm.moe_aux_loss_coeff == want["router_aux_loss_coef"]


def test_hub_and_transformers_5_expert_count_keys_both_read(built, tmp_path: Path) -> None:
    """transformers 5 saves `num_local_experts`, the hub's configs say `num_experts`."""
    saved = json.loads((built["chat"] / "config.json").read_text())["llm_config"]
    assert saved["num_local_experts"] == 4 and "num_experts" not in saved

    def hub(d: dict) -> None:
        d["llm_config"]["num_experts"] = d["llm_config"].pop("num_local_experts")

    ref = read_hf(built["chat"]).spec.llm
    assert read_hf(hf_models.edited_copy(built["chat"], tmp_path / "hub", hub)).spec.llm == ref


def test_one_tensor_per_expert_maps_both_ways(built) -> None:
    """Each expert's gate and up projections are its [gate; up] fc1, the router `mlp.gate`;
    back to HF the split gives the stored tensors bit for bit; the shapes are the spec's."""
    hf = read_hf(built["internvl"])
    reader = SafetensorsReader(hf)
    shapes = canonical_shapes(hf)
    rules = {r.canonical: r for r in language_rules(hf)}
    expert = "llm.layers.1.mlp.experts.local_experts.3."
    fc1 = rules[expert + "linear_fc1.weight"]
    theirs = "language_model.model.layers.1.mlp."
    assert fc1.hf == (theirs + "experts.3.gate_proj.weight", theirs + "experts.3.up_proj.weight")
    assert rules["llm.layers.1.mlp.router.weight"].hf == (theirs + "gate.weight",)
    dense = "llm.layers.1.mlp.linear_fc1.weight"
    assert dense not in rules and dense not in shapes
    for name, rule in rules.items():
        parts = [reader.get(n) for n in rule.hf]
        whole = rule.to_canonical(parts)
        assert tuple(whole.shape) == shapes[name], name
        assert all(torch.equal(a, b) for a, b in zip(rule.to_hf(whole), parts, strict=True))
    gate, up = (reader.get(n) for n in fc1.hf)
    assert torch.equal(fc1.to_canonical([gate, up]), torch.cat([gate, up]))
    assert shapes[expert + "linear_fc2.weight"] == (32, 24)
    assert shapes["llm.layers.1.mlp.router.weight"] == (4, 32)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.update(mlp_only_layers=[1]), r"mlp_only_layers=\[1\]: dense layers"),
        (lambda t: t.update(decoder_sparse_step=2), "decoder_sparse_step=2: only 1"),
        (lambda t: t.update(num_experts_per_tok=5), r"num_experts_per_tok 5: expected 1..4"),
        (lambda t: t.update(shared_expert_intermediate_size=16),
         "shared_expert_intermediate_size=16: shared experts are not built"),
        (lambda t: t.update(model_type="gpt_oss"),
         "'gpt_oss': GPT-OSS is a mixture-of-experts LLM, not supported"),
    ],
)
def test_what_is_not_built_is_refused_by_key(built, tmp_path: Path, edit, message: str) -> None:
    for layout, key in (("internvl", "text_config"), ("chat", "llm_config"),
                        ("qwen3_vl_moe", "text_config")):  # fmt: skip
        if layout != "internvl" and "gpt_oss" in message:
            continue
        dst = hf_models.edited_copy(built[layout], tmp_path / layout, lambda d, k=key: edit(d[k]))
        with pytest.raises(HFConfigError, match=message):
            read_hf(dst)


def test_remote_layout_refuses_gpt_oss(built, tmp_path: Path) -> None:
    def gpt_oss(d: dict) -> None:
        d["llm_config"]["architectures"] = ["GptOssForCausalLM"]

    with pytest.raises(HFConfigError, match=r"\['GptOssForCausalLM'\]: GPT-OSS is a mixture"):
        read_hf(hf_models.edited_copy(built["chat"], tmp_path / "g", gpt_oss))


def test_qwen3_vl_moe_always_renormalises_and_claims_its_specs(built, tmp_path: Path) -> None:
    """Its router renormalises the top k whatever `norm_topk_prob` says (transformers'
    Qwen3VLMoeTextTopKRouter has no such switch); a spec with its tower and experts is its
    family's, without experts the dense qwen3_vl's; a dense text config is refused."""
    from dataclasses import replace

    from megatron_omnibal.models.families.registry import family_of_spec

    def off(d: dict) -> None:
        d["text_config"]["norm_topk_prob"] = False

    hf = read_hf(hf_models.edited_copy(built["qwen3_vl_moe"], tmp_path / "off", off))
    assert hf.spec.llm.moe_norm_topk_prob and hf.llm_arch == "qwen3_moe"
    assert family_of_spec(hf.spec).name == "qwen3_vl_moe"
    dense = replace(hf.spec, llm=replace(hf.spec.llm, num_experts=0, moe_top_k=0,
                                         moe_ffn_hidden_size=0))  # fmt: skip
    assert family_of_spec(dense).name == "qwen3_vl"

    def text(d: dict) -> None:
        d["text_config"]["model_type"] = "qwen3_vl_text"

    with pytest.raises(HFConfigError, match="'qwen3_vl_text': expected qwen3_vl_moe_text"):
        read_hf(hf_models.edited_copy(built["qwen3_vl_moe"], tmp_path / "dense", text))


def test_fused_experts_read_in_both_orientations(built, tmp_path: Path) -> None:
    """The hub's [E, H, 2I] / [E, I, H] and transformers 5's saved [E, 2I, H] / [E, H, I] give
    the same canonical experts: expert e's fc1 is slice e of the saved gate_up_proj."""
    from megatron_omnibal.models.hf_weights import canonical_tensors

    saved = hf_models.qwen3_vl_moe(tmp_path / "saved", hub=False)
    hub, tf = (read_hf(p) for p in (built["qwen3_vl_moe"], saved.path))
    a = dict(canonical_tensors(hub, SafetensorsReader(hub)))
    b = dict(canonical_tensors(tf, SafetensorsReader(tf)))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    fused = saved.model.state_dict()["model.language_model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(a["llm.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"], fused[2])
