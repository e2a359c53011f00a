"""Qwen3-VL through `omnibal convert` and `omnibal compare-hf`, on the tiny random model of
tests/helpers/hf_models.py in the hub's config layout (DeepStack taps after ViT layers 2, 0
and 3, a learned position table, interleaved M-RoPE, a tied head):

- converted at TP=2 over three stages with the ViT over two of them and an uneven LLM split
  (ViT 2 + 2 + 0, LLM 0 + 1 + 2) to torch_dist, exported back bit for bit under the original
  names, and transformers' Qwen3VLForConditionalGeneration loads the export (no missing or
  unexpected keys) and `generate`s what the original generates;
- compare-hf: transformers' forward (its own 3-D positions, a video as one grid per temporal
  patch) equals the stages' within 1e-4 at PP=1, at PP=3 with the ViT over two stages and the
  DeepStack features crossing stages (taps made on stages 0 and 1, LLM layers 0 | 1, 2 on
  stages 1 | 2), and at TP=2 with sequence parallelism.
(The hub-layout round trip at TP=2 x PP=2 is in test_hf_convert.py's family list.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import hf_models
from tests.megatron.checkpoint.test_hf_convert import omnibal, tensors

pytestmark = pytest.mark.megatron

LAYOUTS = {
    "pp1": ["--tp", "1", "--omnibal-vit-pp-layers", "4", "--omnibal-llm-pp-layers", "3"],
    "pp3": ["--tp", "1", "--omnibal-vit-pp-layers", "2,2,0", "--omnibal-llm-pp-layers",
            "0,1,2"],
    "tp2_sp": ["--tp", "2", "--sequence-parallel", "--omnibal-vit-pp-layers", "4",
               "--omnibal-llm-pp-layers", "3"],
}  # fmt: skip


def _generate(model: torch.nn.Module) -> torch.Tensor:
    """Greedy tokens after a prompt with a 4 x 6-patch image."""
    ids = torch.tensor([[3, 4, 253, *[255] * 6, 252, 5, 6]])
    g = torch.Generator().manual_seed(0)
    kw = {"pixel_values": torch.randn(24, 3 * 2 * 4 * 4, generator=g),
          "image_grid_thw": torch.tensor([[1, 4, 6]]), "mm_token_type_ids": (ids == 255).int()}
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, **kw)


def test_convert_export_generate_and_compare_at_three_layouts(tmp_path: Path) -> None:
    built = hf_models.qwen3_vl(tmp_path / "qwen3_vl", hub=True, llm_layers=3, tie=True)
    ckpt, back = tmp_path / "dist", tmp_path / "hf"
    omnibal("convert", "hf-to-megatron", str(built.path), "--tp", "2",
            "--omnibal-vit-pp-layers", "2,2,0", "--omnibal-llm-pp-layers", "0,1,2",
            "--ckpt-format", "torch_dist", "--out", str(ckpt), "--no-progress")  # fmt: skip
    omnibal("convert", "megatron-to-hf", str(ckpt), "--like", str(built.path), "--out",
            str(back), "--no-progress")  # fmt: skip
    original, exported = tensors(built.path), tensors(back)
    assert sorted(exported) == sorted(original)
    assert any(n.startswith("model.visual.deepstack_merger_list.2.") for n in original)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    from transformers import Qwen3VLForConditionalGeneration

    loaded, info = Qwen3VLForConditionalGeneration.from_pretrained(
        back, output_loading_info=True)  # fmt: skip
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert torch.equal(_generate(loaded.float().eval()), _generate(built.model))
    for name, flags in LAYOUTS.items():
        report = json.loads(omnibal("compare-hf", str(built.path), str(ckpt), *flags).stdout)
        assert report["ok"], (name, report)
        assert max(report[k]["max_rel"] for k in ("logits", "vit", "llm")) <= 1e-4, name
        assert report["pp"] == (3 if name == "pp3" else 1)
