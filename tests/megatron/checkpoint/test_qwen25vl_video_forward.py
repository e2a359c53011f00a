"""Qwen2.5-VL with video samples in the VLM stages, against transformers' forward: a tiny random
Qwen2.5-VL (tests/hf_models.py) loaded through the package's own mapping at PP=1 and at PP=2
with the vision tower split over both stages, on the probe samples of megatron.probe (images of
odd grids, text only, and a sample of two videos: 3 temporal patches of 4x6 patches and one of
2x2, 1.25 s per temporal patch, so the tower attends per temporal patch and the M-RoPE time
steps are fractional). Oracle: transformers' forward of each sample with its videos as videos
(`pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`); logits, the tower's output and
the LLM's final hidden states within 1e-4 relative, and PP=2 equal to PP=1.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron_workers"))
from launch import torchrun  # noqa: E402

from megatron_omnibal.megatron.compare.probe import probe_samples  # noqa: E402
from megatron_omnibal.models.hf_config import read_hf  # noqa: E402
from megatron_omnibal.models.hf_reference import reference  # noqa: E402
from tests import hf_models  # noqa: E402

WORKER = Path(__file__).resolve().parents[2] / "megatron_workers" / "hf_worker.py"
CASES = [{"name": "pp1", "tp": 1, "pp": 1, "vit": [4], "llm": [4]},
         {"name": "pp2", "tp": 1, "pp": 2, "vit": [2, 2], "llm": [0, 4]}]  # fmt: skip


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return float((a - b).abs().max() / b.abs().max())


def _outputs(out: Path, case: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob(f"qwen.{case}.stage*.pt")):
        for k, v in torch.load(f).items():
            assert k not in merged, f"{k} on two stages"
            merged[k] = v
    assert merged, f"no outputs for {case}"
    return merged


def test_video_forward_equals_transformers_at_pp1_and_pp2(tmp_path) -> None:
    built = hf_models.qwen2_5_vl(tmp_path / "qwen", flat=True)
    hf = read_hf(built.path)
    samples = probe_samples(hf.spec)
    videos = [s for s in samples if bool((s.grid_seconds > 0).any())]
    assert len(videos) == 1 and videos[0].image_grid[:, 0].tolist() == [3, 1]
    torch.save([asdict(s) for s in samples], tmp_path / "batch.pt")
    ref = reference(built.model, hf, samples)
    cfg = tmp_path / "cases.json"
    cfg.write_text(json.dumps({"models": {"qwen": {"hf_dir": str(built.path),
                                                   "batch": str(tmp_path / "batch.pt")}},
                               "cases": CASES}))  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, stderr = torchrun(WORKER, 2, [str(cfg), str(out)], timeout=600)
    assert code == 0, f"worker failed ({code}):\n{stdout[-2000:]}\n{stderr[-4000:]}"
    got = {case["name"]: _outputs(out, case["name"]) for case in CASES}
    for name, outputs in got.items():
        for key in ("logits", "llm", "vit"):
            assert _relative(outputs[key], ref[key]) <= 1e-4, (name, key)
    for key in ("logits", "llm", "vit"):
        assert _relative(got["pp2"][key], got["pp1"][key]) <= 1e-5, key
