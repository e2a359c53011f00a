"""Reading Hugging Face checkpoint directories into the model spec: every field the stage
module builds comes from the checkpoint's own config (checked against the configs the tiny
models were built from), and what cannot be built exactly is an error naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_omnibal.models.hf_config import HFConfigError, read_hf  # noqa: E402
from tests.helpers import hf_models  # noqa: E402


def test_internvl_6b_like(tmp_path: Path) -> None:
    hf = read_hf(hf_models.internvl(tmp_path / "m", six_b=True).path)
    v, p, llm = hf.spec.vit, hf.spec.projector, hf.spec.llm
    assert (hf.family, hf.llm_arch) == ("internvl", "qwen2")
    assert (v.num_layers, v.hidden_size, v.num_attention_heads, v.norm) == (4, 48, 3, "rmsnorm")
    assert v.qk_norm and v.layer_scale and not v.qkv_bias and v.post_norm and v.class_token
    assert (p.type, p.downsample, p.shuffle_version) == ("pixel_shuffle_mlp", 0.5, 2)
    assert llm.qkv_bias and llm.tie_embeddings and llm.rotary_base == 5000.0
    assert (llm.num_query_groups, llm.norm_eps, llm.vocab_size) == (2, 1e-5, 160)
    assert (hf.spec.image_token_id, hf.spec.image_start_id, hf.spec.image_end_id) == (150, 151, 152)
    assert hf.spec.tokens_per_tile == 4


def test_internvl_300m_like_and_the_remote_layout(tmp_path: Path) -> None:
    hf = read_hf(hf_models.internvl(tmp_path / "m", six_b=False).path)
    v = hf.spec.vit
    assert v.norm == "layernorm" and v.qkv_bias and not v.qk_norm and not v.post_norm
    assert hf.llm_arch == "llama" and not hf.spec.llm.qkv_bias
    assert not hf.spec.llm.tie_embeddings
    chat = read_hf(hf_models.internvl_chat(tmp_path / "c").path)
    assert (chat.family, chat.llm_arch) == ("internvl_chat", "internlm2")
    assert chat.spec.vit.qk_norm and chat.spec.vit.qk_norm_eps == 1e-6
    assert chat.spec.image_token_id == hf_models.IMG_CONTEXT


def test_llava(tmp_path: Path) -> None:
    hf = read_hf(hf_models.llava(tmp_path / "m").path)
    v = hf.spec.vit
    assert hf.vit_checkpoint_layers == 5 and v.num_layers == 4  # vision_feature_layer -2
    assert v.pre_norm and not v.patch_bias and v.activation == "quick_gelu" and v.norm_eps == 1e-5
    assert hf.spec.projector.type == "mlp" and hf.spec.tokens_per_tile == 16
    assert hf.spec.image_token_id == hf_models.LLAVA_IMAGE and hf.spec.image_start_id == -1


def test_internvl3_5_and_internvl3_in_both_layouts(tmp_path: Path) -> None:
    """Qwen3: per-head QK-norm, head size from head_dim (16, not 32 / 4), no biases; Qwen2.5
    (InternVL3): qkv bias; OpenGVLab's layout names the LLM in llm_config.architectures."""
    native = read_hf(hf_models.internvl(tmp_path / "n", six_b=False, text="qwen3", tie=True).path)
    chat = read_hf(hf_models.internvl_chat(tmp_path / "c", text="qwen3", six_b=False).path)
    for hf, family in ((native, "internvl"), (chat, "internvl_chat")):
        llm = hf.spec.llm
        assert (hf.family, hf.llm_arch) == (family, "qwen3")
        assert llm.qk_norm and not llm.qkv_bias and llm.kv_channels == 16
        assert (llm.q_size, llm.kv_size) == (64, 32)
    assert native.spec.llm.tie_embeddings and not chat.spec.llm.tie_embeddings
    v3 = read_hf(hf_models.internvl_chat(tmp_path / "q2", text="qwen2", six_b=False).path)
    assert v3.llm_arch == "qwen2" and v3.spec.llm.qkv_bias and not v3.spec.llm.qk_norm
    assert v3.spec.vit.qkv_bias and v3.spec.vit.norm == "layernorm"


def test_llava_on_llama3(tmp_path: Path) -> None:
    """Llama-3.x RoPE: base and scaling factor both reach the spec (factor 32: Llama-3.2)."""
    hf = read_hf(hf_models.llava(tmp_path / "m", text="llama3").path)
    assert (hf.spec.llm.rotary_base, hf.spec.llm.rope_scaling_factor) == (500000.0, 32.0)
    plain = read_hf(hf_models.llava(tmp_path / "p").path)
    assert plain.spec.llm.rope_scaling_factor == 0.0


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(model_type="qwen2_vl"), "model_type 'qwen2_vl' is not supported"),
        (lambda d: d.update(vision_feature_layer=[-2, -1]), "features from several layers"),
        (lambda d: d.update(model_type="qwen2_vl"),
         "model_type 'qwen2_vl' is not supported yet: Qwen2-VL's vision tower"),
        (lambda d: d["text_config"].update(rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
         "original_max_position_embeddings=128: megatron-core builds only 8192"),
        (lambda d: d["text_config"].update(rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 2.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
         "low_freq_factor=2.0: megatron-core builds only 1"),
        (lambda d: d["text_config"].update(rope_parameters={
            "rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}),
         "RoPE scaling 'linear' is not supported"),
        (lambda d: d["text_config"].update(model_type="gpt_oss"),
         "'gpt_oss': GPT-OSS is a mixture-of-experts LLM, not supported"),
        (lambda d: d["text_config"].update(model_type="qwen2", use_sliding_window=True),
         "use_sliding_window=true"),
        (lambda d: d["text_config"].update(rope_parameters={"rope_type": "llama3"}),
         "transformers rejects it"),
        (lambda d: d["vision_config"].update(hidden_act="swish"), "activation 'swish'"),
    ],
)
def test_what_cannot_be_built_exactly_is_refused(tmp_path: Path, edit, message: str) -> None:
    src = hf_models.llava(tmp_path / "m").path
    with pytest.raises(HFConfigError, match=message):
        read_hf(hf_models.edited_copy(src, tmp_path / "bad", edit))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["llm_config"].update(architectures=["GptOssForCausalLM"]),
         r"\['GptOssForCausalLM'\]: GPT-OSS is a mixture-of-experts LLM"),
        (lambda d: d["llm_config"].update(architectures=["Phi3ForCausalLM"]),
         "supported are LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3For"),
        (lambda d: d["llm_config"].update(attention_bias=True),
         "attention_bias=true .biased o_proj. is not supported"),
        (lambda d: d["llm_config"].update(rope_scaling={"type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 64}),
         "RoPE scaling 'yarn' is not supported"),
    ],
)
def test_remote_layout_refusals(tmp_path: Path, edit, message: str) -> None:
    src = hf_models.internvl_chat(tmp_path / "c", text="qwen3", six_b=False).path
    with pytest.raises(HFConfigError, match=message):
        read_hf(hf_models.edited_copy(src, tmp_path / "bad", edit))


def test_remote_layout_without_its_image_token_and_a_missing_config(tmp_path: Path) -> None:
    chat = hf_models.internvl_chat(tmp_path / "c").path
    (chat / "tokenizer_config.json").unlink()
    with pytest.raises(HFConfigError, match="no <IMG_CONTEXT> token"):
        read_hf(chat)
    (tmp_path / "empty").mkdir()
    with pytest.raises(HFConfigError, match="config.json: no such file"):
        read_hf(tmp_path / "empty")


def test_stats_reads_each_new_family_from_its_checkpoint(tmp_path: Path, capsys) -> None:
    """`omnibal stats --model HF_DIR` takes tokens per tile and the chat template from the
    checkpoint: InternVL3/3.5 (both layouts) count with internvl2_5; a LLaVA on Llama-3.x that
    ships its own chat template counts with it ("hf"), not Vicuna's; Qwen2.5-VL is refused."""
    from megatron_omnibal.cli import main as cli_main
    from megatron_omnibal.models.data_side import model_data_side

    dirs = {
        "internvl3_5": hf_models.internvl(tmp_path / "a", six_b=False, text="qwen3").path,
        "internvl3_5_chat": hf_models.internvl_chat(tmp_path / "b", text="qwen3",
                                                    six_b=False).path,  # fmt: skip
        "internvl3_chat": hf_models.internvl_chat(tmp_path / "c", text="qwen2",
                                                  six_b=False).path,  # fmt: skip
        "llava_llama3": hf_models.llava(tmp_path / "d", text="llama3").path,
    }
    for name, path in dirs.items():
        side = model_data_side(read_hf(path).spec, path)
        llava = name.startswith("llava")
        assert side.tiling.tokens_per_tile == (16 if llava else 4), name
        assert side.template == ("vicuna_v1" if llava else "internvl2_5"), name
    llava = dirs["llava_llama3"]
    (llava / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}"
                                               "{% endfor %}")  # fmt: skip
    assert model_data_side(read_hf(llava).spec, llava).template == "hf"
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    (tmp_path / "d.json").write_text("[]")
    code = cli_main(["stats", str(tmp_path / "d.json"), "--model", str(qwen), "--out",
                     str(tmp_path / "o.npz"), "--no-progress"])  # fmt: skip
    assert code == 2 and "'qwen2_vl' is not supported yet" in capsys.readouterr().err
