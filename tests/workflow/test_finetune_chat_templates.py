"""`omnibal finetune` on checkpoints that carry their own chat template, as released Qwen2.5-VL,
Qwen3-VL (its DeepStack tower, 8 px merge groups in the tiny model) and llava-hf checkpoints
do: stats picks the template (`hf`), training builds every sample with it (each checked against
the length file) and trains (export and compare-hf of these families: tests/megatron/checkpoint).
Tiny random models (tests/helpers/hf_models.py) with the generated dataset's tokenizer and a
template of the released form (tests/helpers/chat_templates.py); one process, PP=1, a few steps,
up to training.
"""

import json
import re

import pytest

from megatron_omnibal.data.formats.generate import SYSTEM_PROMPT, qa_dataset
from megatron_omnibal.data.lengths import read_stats_config
from tests.helpers import chat_templates as ct
from tests.helpers import hf_models
from tests.helpers.finetune_runs import finetune, step_status, write_config

pytestmark = [pytest.mark.megatron, pytest.mark.slow]
ITERS = 3


def _qwen(folder, tokenizer_json):
    ckpt = hf_models.qwen2_5_vl(folder / "hf", llm_layers=2).path
    (ckpt / "preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 9, "patch_size": 14,
         "merge_size": 2, "temporal_patch_size": 2}))
    ids = {"<|image_pad|>": hf_models.QWEN_IMAGE, "<|video_pad|>": hf_models.QWEN_VIDEO,
           "<|vision_start|>": hf_models.QWEN_START, "<|vision_end|>": hf_models.QWEN_END}
    ct.model_tokenizer(ckpt, tokenizer_json, ct.QWEN2_5_VL, ids, eos="<|im_end|>")


def _qwen3(folder, tokenizer_json):
    ckpt = hf_models.qwen3_vl(folder / "hf", llm_layers=3).path
    (ckpt / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 8 * 8 * 4, "longest_edge": 8 * 8 * 9}, "patch_size": 4,
         "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5],
         "image_std": [0.5, 0.5, 0.5]}))
    ids = {"<|vision_end|>": 252, "<|vision_start|>": 253, "<|video_pad|>": 254,
           "<|image_pad|>": 255}
    ct.model_tokenizer(ckpt, tokenizer_json, ct.QWEN3_VL, ids, eos="<|im_end|>")


def _llava(folder, tokenizer_json):
    ckpt = hf_models.llava(folder / "hf", llm_layers=2).path
    ct.model_tokenizer(ckpt, tokenizer_json, ct.LLAVA_HF, {"<image>": hf_models.LLAVA_IMAGE},
                       bos="<s>", eos="</s>", bos_processor=True)


@pytest.mark.parametrize("family", [_qwen, _qwen3, _llava],
                         ids=["qwen2_5_vl", "qwen3_vl", "llava_hf"])
def test_a_checkpoint_with_its_own_chat_template_trains_end_to_end(tmp_path, family):
    made = qa_dataset(tmp_path / "data", samples=24, images=7, seed=3)
    family(tmp_path, made.tokenizer)
    config = write_config(tmp_path, "run.yaml", pp=1, gpus_per_node=1, iters=ITERS,
                          global_batch=4, save_interval=ITERS, preflight=False)
    proc = finetune(config, "--until", "train", timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert step_status(proc.stdout) == dict.fromkeys(("stats", "plan", "convert", "train"),
                                                     "ran")
    stored = read_stats_config(tmp_path / "out" / "lengths.npz")
    assert stored["template"] == "hf" and stored["system"] == SYSTEM_PROMPT
    assert len(stored["chat_template_sha"]) == 16
    tracker = tmp_path / "out/checkpoints/train/latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == str(ITERS)
    assert re.search(rf"training: iteration {ITERS}, lm loss \d+\.\d+ -> \d+\.\d+",
                     proc.stdout)
