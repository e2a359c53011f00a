"""A LoRA run exported as a PEFT adapter and as a merged model, end to end on a tiny random
InternVL (InternViT-6B-like tower: 3 heads padded to 4 at TP=2; Qwen2 LLM with qkv bias, GQA,
tied head): converted, trained with adapters on every linear layer of both towers and the
projector in full at TP=2 with sequence parallelism, exported, and checked against the trained
Megatron stages' logits.

Oracles: transformers' forward of the merged export, and of the base model with the adapter
through `peft` itself, both equal the trained stages' (compare-hf, 1e-4); an adapter whose
fused B is split into q, k, v contiguously instead of per KV group fails that check (its logits
differ by more than 1e-3: the adapters change the model far above the tolerance). An
adapter-only checkpoint (the base from --pretrained-checkpoint) of the same run exports the same
merged model and adapter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import hf_models
from tests.megatron.checkpoint.test_hf_convert import _lengths, _train, omnibal, tensors

pytestmark = pytest.mark.megatron

LORA = ["--omnibal-lora-rank", "4", "--omnibal-lora-alpha", "8", "--omnibal-lora-dropout", "0",
        "--omnibal-lora-targets", "linear_qkv,linear_proj,linear_fc1,linear_fc2,vit.*",
        "--omnibal-lora-train", "projector"]  # fmt: skip
PROJECTOR = 6  # LayerNorm, fc1, fc2: weights and biases, trained in full
LAYOUT = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
          "--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("lora_export")
    built = hf_models.internvl(tmp / "base", six_b=True)
    ckpt, lengths = tmp / "converted", _lengths(tmp / "lengths.npz")
    omnibal("convert", "hf-to-megatron", str(built.path), "--tp", "2",
            "--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "4",
            "--out", str(ckpt), "--no-progress")  # fmt: skip
    paths = {"base": built.path}
    for save in ("full", "adapters"):
        trained = tmp / f"trained_{save}"
        _train(trained, built.path, ckpt, lengths, *LAYOUT, *LORA, "--omnibal-lora-save", save)
        merged, adapter = tmp / f"merged_{save}", tmp / f"adapter_{save}"
        omnibal("convert", "megatron-to-hf", str(trained), "--like", str(built.path), "--out",
                str(merged), "--adapter-out", str(adapter), "--no-progress")  # fmt: skip
        paths.update({f"trained_{save}": trained, f"merged_{save}": merged,
                      f"adapter_{save}": adapter})  # fmt: skip
    return paths


def _compare(hf: Path, ckpt: Path, *flags: str) -> dict:
    return json.loads(omnibal("compare-hf", str(hf), str(ckpt), *flags, check=False).stdout)


def test_merged_and_peft_exports_equal_the_trained_stages(run: dict) -> None:
    """One compare-hf: the merged export, and the base model with the adapter through peft."""
    report = _compare(run["merged_full"], run["trained_full"], "--adapter",
                      str(run["adapter_full"]), "--base", str(run["base"]))  # fmt: skip
    assert report["ok"], report
    assert max(report["adapter"][k]["max_rel"] for k in ("logits", "vit", "llm")) <= 1e-4
    original, merged = tensors(run["base"]), tensors(run["merged_full"])
    assert set(merged) == set(original)
    changed = {n for n, t in original.items() if not torch.equal(merged[n], t)}
    projector = {n for n in changed if n.startswith("multi_modal_projector.")}
    adapted = ("q_proj", "k_proj", "v_proj", "o_proj", "projection_layer", "gate_proj",
               "up_proj", "down_proj", "fc1", "fc2")  # fmt: skip
    assert len(projector) == PROJECTOR
    assert all(n.rsplit(".", 2)[-2] in adapted and n.endswith(".weight")
               for n in changed - projector), sorted(changed)  # fmt: skip
    assert len(changed - projector) == 4 * 6 + 4 * 7  # ViT: q, k, v, proj, fc1, fc2; + gate/up


def test_peft_adapter_config(run: dict) -> None:
    """The adapter's config names every adapted HF module, and the projector trained in full
    as PEFT's modules_to_save."""
    config = json.loads((run["adapter_full"] / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert len(config["target_modules"]) == 4 * 6 + 4 * 7
    assert config["modules_to_save"] == ["model.multi_modal_projector"]
    saved = tensors(run["adapter_full"])
    assert sum(k.startswith("base_model.model.model.multi_modal_projector.") for k in saved) \
        == PROJECTOR


def test_contiguous_qkv_split_fails_the_check(run: dict, tmp_path: Path) -> None:
    """The LLM's B rows re-split as [q | k | v] of the fused matrix (megatron-core's layout is
    per KV group: [q heads of group 0, k0, v0, q heads of group 1, ...])."""
    from safetensors.torch import load_file, save_file

    from megatron_omnibal.models.families.shared.weights import qkv_fuse as _qkv_fuse

    src = run["adapter_full"]
    adapter = load_file(src / "adapter_model.safetensors")
    fuse = _qkv_fuse(4, 2, 8)  # the LLM: 4 heads of 8 in 2 KV groups
    for i in range(4):
        pre = f"base_model.model.model.language_model.layers.{i}.self_attn"
        keys = [f"{pre}.{p}_proj.lora_B.weight" for p in "qkv"]
        fused = fuse([adapter[k] for k in keys])
        q, k, v = fused.split([32, 16, 16])
        adapter.update(dict(zip(keys, (q, k, v), strict=True)))
    bad = tmp_path / "contiguous"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    save_file(adapter, str(bad / "adapter_model.safetensors"), metadata={"format": "pt"})
    report = _compare(run["base"], run["trained_full"], "--adapter", str(bad))
    assert not report["ok"] and report["logits"]["max_rel"] > 1e-3, report


def test_adapter_only_checkpoint_exports_the_same(run: dict) -> None:
    """The adapters-only save holds no base weight (the adapters and the projector trained in
    full); its exports equal the full save's."""
    from megatron_omnibal.megatron.checkpoint.checkpoint_reader import (
        canonical_groups,
        open_checkpoint,
    )

    ckpt = open_checkpoint(run["trained_adapters"])
    assert ckpt.adapters_only and not open_checkpoint(run["trained_full"]).adapters_only
    names = {n for g in canonical_groups(ckpt) for n in g}
    adapters = {n for n in names if n.endswith((".lora_a", ".lora_b"))}
    assert len(adapters) == 2 * (4 * 4 + 4 * 4)
    assert len(names - adapters) == PROJECTOR
    assert all(n.startswith("projector.") for n in names - adapters)
    for kind in ("merged", "adapter"):
        full, only = tensors(run[f"{kind}_full"]), tensors(run[f"{kind}_adapters"])
        assert set(full) == set(only)
        for name, t in full.items():
            assert torch.equal(only[name], t), (kind, name)
