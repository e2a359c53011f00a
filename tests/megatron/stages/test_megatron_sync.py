"""No host-device synchronisation per micro-batch in the stage's forward or the loss.

On a GPU every value read back from the device (a batch check's int(), a boolean mask's
nonzero) stalls the pipeline once per micro-batch. The batch is checked and measured on the CPU
(step.stage_inputs); this test trains one real PP=2 step under a counter of such calls.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "helpers" / "megatron_workers"))
from launch import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
WORKER = ROOT / "tests" / "helpers" / "megatron_workers" / "sync_worker.py"
SPEC = {
    "vit": {"num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
            "image_size": 16, "patch_size": 4, "class_token": True},
    "projector": {"type": "pixel_shuffle_mlp", "downsample": 0.5, "hidden_size": 48},
    "llm": {"num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
            "num_query_groups": 2, "vocab_size": 256},
}  # fmt: skip


def test_training_step_has_no_device_sync_per_micro_batch(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    code, out, err = run_ranks(WORKER, 2, [str(spec), str(tmp_path / "sync.json")], timeout=300)
    assert code == 0, err[-3000:]
    stages = [json.loads((tmp_path / f"sync.stage{r}.json").read_text()) for r in range(2)]
    for s in stages:
        assert s["forwards"] == 3, s  # every micro-batch's forward ran under the counter
        assert s["calls"] == [], s
        # the counter sees reads-back: the check the stage used to run on the device has them
        assert {c.split(" at ")[0] for c in s["control"]} >= {"tolist", "__int__"}, s
    assert stages[1]["losses"] == 3
