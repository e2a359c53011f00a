"""Hugging Face checkpoints in the VLM stages at every layout, against transformers' forward.

Tiny families (tests/helpers/hf_models.py): InternVL with a 6B-like tower (RMSNorm, QK-norm across
heads, layer scale, no qkv bias, final LayerNorm; Qwen2 with a tied head: InternVL3's layout),
InternVL with a 300M-like tower (LayerNorm, qkv bias; Llama), the OpenGVLab InternVL-Chat layout
(fused qkv, InternLM2 wqkv) and LLaVA-1.5 (CLIP, feature layer -2); and the newer LLMs:
InternVL3.5 (Qwen3: per-head QK-norm, head size 16 on width 32, tied head) in transformers'
layout, InternVL3.5 and InternVL3 (Qwen3 / Qwen2) in OpenGVLab's, and LLaVA on Llama-3.x (llama3
RoPE scaling), and Qwen2.5-VL (native-resolution tower with windowed and full attention, patch
merger, M-RoPE over packed samples) from the hub's flat config.json and from transformers'
nested one. The first four are loaded through the package's own mapping and sharding at
PP=1, 2 and 4 (the ViT split over two stages, one stage holding the ViT tail and the LLM's first
layers), TP=2 with and without sequence parallelism, and TP=2 x PP=2; the newer ones at PP=1,
TP=2 and TP=2 x PP=2; all at PP=3 with the ViT over the first two stages (a launch of its own).
Oracle: transformers' forward of the same checkpoint, sample by sample (models.hf_reference
runs it on the probe inputs of megatron.probe: two images over three tiles, a video of three
one-tile frames with text between them, a text-only sample). Logits (real vocabulary), the ViT
features entering the projector and the LLM's final hidden states must agree within 1e-4
relative (max abs difference / max abs value) in fp32, the RoPE frequencies the stages built
within 1e-6.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_ranks  # noqa: E402

from megatron_omnibal.megatron.compare.probe import probe_samples  # noqa: E402
from megatron_omnibal.models.hf_config import read_hf  # noqa: E402
from megatron_omnibal.models.hf_reference import reference  # noqa: E402
from tests.helpers import hf_models  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "megatron_workers" / "hf_worker.py"
RTOL = 1e-4
FAMILIES = ("internvl_6b", "internvl_300m", "internvl_chat", "llava")
NEW_FAMILIES = ("internvl3_5", "internvl3_5_chat", "internvl3_chat", "llava_llama3",
                "qwen2_5_vl", "qwen2_5_vl_flat")  # fmt: skip
NEW_CASES = ("pp1", "tp2", "tp2pp2_sp")
PP3_CASES = [{"name": "pp3_split", "tp": 1, "pp": 3, "vit": [2, 2, 0], "llm": [0, 2, 2]}]
CASES = [
    {"name": "pp1", "tp": 1, "pp": 1, "vit": [4], "llm": [4]},
    {"name": "pp2", "tp": 1, "pp": 2, "vit": [4, 0], "llm": [0, 4]},
    {"name": "pp4_split", "tp": 1, "pp": 4, "vit": [2, 2, 0, 0], "llm": [0, 1, 2, 1]},
    {"name": "tp2", "tp": 2, "pp": 1, "vit": [4], "llm": [4]},
    {"name": "tp2_sp", "tp": 2, "pp": 1, "vit": [4], "llm": [4], "sequence_parallel": True},
    {"name": "tp2pp2_sp", "tp": 2, "pp": 2, "vit": [2, 2], "llm": [0, 4],
     "sequence_parallel": True},
]  # fmt: skip


def build(family: str, root: Path) -> hf_models.Built:
    path = root / family
    if family == "internvl3_5":
        return hf_models.internvl(path, six_b=False, text="qwen3", tie=True)
    if family == "internvl3_5_chat":
        return hf_models.internvl_chat(path, text="qwen3", six_b=False)
    if family == "internvl3_chat":
        return hf_models.internvl_chat(path, text="qwen2", six_b=False)
    if family == "llava_llama3":
        return hf_models.llava(path, text="llama3")
    if family.startswith("qwen2_5_vl"):
        return hf_models.qwen2_5_vl(path, flat=family.endswith("_flat"))
    if family == "internvl_6b":
        return hf_models.internvl(path, six_b=True)
    if family == "internvl_300m":
        return hf_models.internvl(path, six_b=False)
    if family == "internvl_chat":
        return hf_models.internvl_chat(path)
    return hf_models.llava(path)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("hf")
    models, refs = {}, {}
    for family in FAMILIES + NEW_FAMILIES:
        built = build(family, root)
        hf = read_hf(built.path)
        batch = probe_samples(hf.spec)
        torch.save([asdict(s) for s in batch], root / f"{family}.batch.pt")
        ref = reference(built.model, hf, batch)
        ref["rope_inv_freq"] = built.model.model.language_model.rotary_emb.inv_freq
        refs[family] = (ref, batch)
        models[family] = {"hf_dir": str(built.path), "batch": str(root / f"{family}.batch.pt")}
        if family in NEW_FAMILIES:
            models[family]["cases"] = list(NEW_CASES)
    out = root / "out"
    out.mkdir()
    for ranks, cases in ((4, CASES), (3, PP3_CASES)):
        cfg = root / f"cases{ranks}.json"
        every = {k: {**m, "cases": [c["name"] for c in cases]} for k, m in models.items()}
        cfg.write_text(json.dumps({"models": models if ranks == 4 else every, "cases": cases}))
        code, stdout, stderr = run_ranks(WORKER, ranks, [str(cfg), str(out)], timeout=1500)
        if code:
            pytest.fail(f"worker failed ({code}):\n{stdout[-3000:]}\n{stderr[-6000:]}")
    return out, refs


def outputs(out: Path, family: str, case: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    files = sorted(out.glob(f"{family}.{case}.stage*.pt"))
    assert files, f"no outputs for {family} {case}"
    for f in files:
        for k, v in torch.load(f).items():
            assert k not in merged, f"{k} on two stages"
            merged[k] = v
    return merged


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return float((a - b).abs().max() / b.abs().max())


PAIRS = [(f, c["name"]) for f in FAMILIES for c in CASES + PP3_CASES] + [
    (f, c) for f in NEW_FAMILIES for c in (*NEW_CASES, "pp3_split")
]


@pytest.mark.parametrize(("family", "case"), PAIRS)
def test_logits_and_tower_outputs_equal_transformers(results, family: str, case: str) -> None:
    out, refs = results
    ref, batch = refs[family]
    got = outputs(out, family, case)
    # Short sequences barely feel Llama-3's low-frequency scaling (factor 8 instead of 32
    # moves these logits by 4e-5): the frequencies are compared directly.
    assert relative(got["rope_inv_freq"], ref["rope_inv_freq"]) <= 1e-6, "RoPE frequencies"
    assert relative(got["logits"], ref["logits"]) <= RTOL, "logits"
    assert relative(got["llm"], ref["llm"]) <= RTOL, "LLM final hidden states"
    if family.startswith("qwen2_5_vl"):  # the last block's output, patches in window order
        assert relative(got["vit"], ref["vit"]) <= RTOL, "ViT features"
        return
    flags = torch.cat([s.image_flags for s in batch]).bool()
    assert relative(got["vit"][flags], ref["vit"]) <= RTOL, "ViT features"
