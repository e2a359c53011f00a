"""`make demo` (scripts/demo.sh) and the dataset it generates.

The generated dataset must be what the demo claims: real JPEG/PNG files in an InternVL meta +
JSONL layout, with answers that follow from the question and the picture (checked against the
pixels and sizes read back from the files, not against the generator's own bookkeeping). The
demo's data and balance sections run as a user runs them, through bash, and their outputs must
agree with the dataset; the training and step-time sections run at a few steps (megatron).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from megatron_omnibal.data.formats.generate import COLOURS, NUMBERS, qa_dataset
from megatron_omnibal.data.lengths import load_lengths
from tests.helpers.finetune_runs import LOCAL_RANKS

ROOT = Path(__file__).resolve().parents[2]


def _jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _colour_of(path):
    """The named colour nearest to the picture's mean pixel."""
    mean = np.asarray(Image.open(path).convert("RGB"), np.float64).reshape(-1, 3).mean(axis=0)
    return min(COLOURS, key=lambda name: np.sum((mean - np.array(COLOURS[name])) ** 2))


def _shape_of(path):
    w, h = Image.open(path).size
    return "wide" if w >= 1.5 * h else "tall" if h >= 1.5 * w else "square"


def _expected_answers(rec, images):
    """Each gpt turn's answer, worked out from the question and the picture files."""
    files = rec.get("image") or []
    files = [files] if isinstance(files, str) else files
    answers = []
    for human in rec["conversations"][::2]:
        q = human["value"].replace("<image>\n", "")
        if "same colour" in q:
            same = _colour_of(images / files[0]) == _colour_of(images / files[1])
            answers.append("yes ." if same else "no .")
        elif "colour" in q:
            answers.append(f"it is {_colour_of(images / files[0])} .")
        elif "wide , tall or square" in q:
            answers.append(f"it is {_shape_of(images / files[0])} .")
        elif q.startswith("count from"):
            first, last = (NUMBERS.index(w) for w in q.split()[2:5:2])
            answers.append(" ".join(NUMBERS[first : last + 1]) + " .")
        else:
            assert q.startswith("what comes after"), q
            answers.append(NUMBERS[NUMBERS.index(q.split()[3]) + 1] + " .")
    return answers


def test_qa_dataset_answers_follow_from_question_and_picture(tmp_path):
    made = qa_dataset(tmp_path / "qa", samples=160, images=40, seed=3)
    root = tmp_path / "qa"
    meta = json.loads(made.meta.read_text())
    assert set(meta) == {"pictures", "numbers"}
    images = root / meta["pictures"]["root"]
    formats = {Image.open(p).format for p in images.iterdir()}
    assert formats == {"JPEG", "PNG"}
    pictures, numbers = _jsonl(root / "pictures.jsonl"), _jsonl(root / "numbers.jsonl")
    assert len(pictures) + len(numbers) == 160 and made.kinds == {"pictures": 120, "numbers": 40}
    for rec in pictures + numbers:
        got = [turn["value"] for turn in rec["conversations"][1::2]]
        assert got == _expected_answers(rec, images), rec["id"]
    # every kind of question is there, with both answers of the two-picture question
    questions = {rec["conversations"][0]["value"].split("\n")[-1].split()[0] for rec in
                 pictures + numbers}
    assert questions == {"what", "is", "are", "count"}
    assert {r["conversations"][1]["value"] for r in pictures
            if isinstance(r["image"], list)} == {"yes .", "no ."}
    # the same seed writes the same dataset
    again = qa_dataset(tmp_path / "again", samples=160, images=40, seed=3)
    assert (tmp_path / "again" / "pictures.jsonl").read_text() == (
        root / "pictures.jsonl").read_text()
    assert again.tokenizer.read_text() == made.tokenizer.read_text()


def _demo(out, *sections, timeout, **env):
    """The demo run by this test's own interpreter (wherever its environment lives)."""
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh"), *sections],
        env={**os.environ, "DEMO_OUT": str(out), "PYTHON": sys.executable, **env},
        capture_output=True, text=True, timeout=timeout, cwd=ROOT)  # fmt: skip


def test_demo_runs_the_interpreter_it_is_given(tmp_path):
    """PYTHON wins; without it VENV names the environment (as `make demo VENV=x` passes it),
    so a test run by an interpreter outside .venv demos that interpreter's installation."""
    calls = tmp_path / "calls.txt"
    wrapper = tmp_path / "venv" / "bin" / "python"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    proc = _demo(tmp_path / "a", "data", timeout=300, DEMO_SAMPLES="40", PYTHON=str(wrapper))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "-m megatron_omnibal.cli stats" in calls.read_text()
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(DEMO_OUT=str(tmp_path / "b"), VENV=str(tmp_path / "venv"), DEMO_SAMPLES="40")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), "data"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert calls.read_text().count("-m megatron_omnibal.cli stats") == 2


def test_make_demo_passes_its_environment_to_the_demo():
    proc = subprocess.run(["make", "-n", "demo", "VENV=/elsewhere/env"], capture_output=True,
                          text=True, cwd=ROOT, check=True)  # fmt: skip
    assert "PYTHON=/elsewhere/env/bin/python bash scripts/demo.sh" in proc.stdout


def test_demo_data_and_balance_sections(tmp_path):
    """The generated dataset through `omnibal stats`, and the balance at DP 64, as the demo
    runs them: one length record per annotation record (pictures carry image tiles, counting
    samples a dummy one), a balance plan of every shipped sample, the printed paths written."""
    out = tmp_path / "demo"
    proc = _demo(out, "data", "balance", timeout=300, DEMO_SAMPLES="200")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lengths = load_lengths(out / "data" / "lengths.npz")
    pictures = _jsonl(out / "data" / "pictures.jsonl")
    numbers = _jsonl(out / "data" / "numbers.jsonl")
    assert len(lengths) == len(pictures) + len(numbers) == 200
    # meta order: pictures first; their tiles are all real, a counting sample has one dummy
    images = [len(r["image"]) if isinstance(r["image"], list) else 1 for r in pictures]
    tiles, real = lengths.vit[: len(pictures)], lengths.image_flags[: len(pictures)]
    assert (real == tiles).all() and (tiles >= np.array(images)).all()
    assert tiles.max() > 2  # pictures wider than a tile are tiled
    assert (lengths.vit[len(pictures):] == 1).all()
    assert (lengths.image_flags[len(pictures):] == 0).all()
    shipped = load_lengths(ROOT / "examples" / "data" / "internvl_subset.npz")
    figures = json.loads((out / "balance.json").read_text())
    assert figures["meta"]["dp_size"] == 64
    assert figures["plan"]["trained_samples"] == len(shipped)
    assert figures["plan"]["tokens_max_mean"] < figures["random_batching"]["tokens_max_mean"]
    assert Image.open(out / "balance.png").format == "PNG"
    for path in (out / "balance.png", out / "data" / "lengths.npz"):
        assert f"wrote {path}" in proc.stdout + proc.stderr
    summary = proc.stdout.split("== summary")[1]
    assert "data     200 samples over 51 JPEG/PNG files" in summary
    assert f"tokens {figures['plan']['tokens_max_mean']:.3f} (random " in summary


def test_demo_refuses_an_unknown_section_and_training_without_data(tmp_path):
    proc = _demo(tmp_path, "plot", timeout=60)
    assert proc.returncode == 2 and "unknown section 'plot'" in proc.stderr
    proc = _demo(tmp_path, "train", timeout=60)
    assert proc.returncode == 2 and "run the data section first" in proc.stderr


@pytest.mark.megatron
@pytest.mark.slow
def test_demo_trains_on_the_generated_data_and_compares_step_times(tmp_path):
    """The training section (`omnibal finetune`) on the generated samples (30 steps of 16
    samples, half the demo's batch: the loss must fall well below its start, since the answers
    are learnable; it ends near half of it) and the step-time section
    at its fewest steps. The condensed log must hold every logged iteration of Megatron's own
    log; the export must pass compare-hf; the step-time report both runs, with the baseline's
    fixed-size batches and the plan's stages. The ranks of both start with local_ranks as
    $TORCHRUN (real torchrun: tests/scripts/test_scripts_launch.py)."""
    out = tmp_path / "demo"
    proc = _demo(out, "data", timeout=120, DEMO_SAMPLES="400")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _demo(out, "train", "compare", timeout=900, DEMO_STEPS="30", DEMO_BATCH="16",
                 DEMO_COMPARE_STEPS="4", TORCHRUN=LOCAL_RANKS)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    log = (out / "finetune" / "logs" / "train.log").read_text()
    losses = [float(x) for x in re.findall(r"iteration +\d+/ +30 \|.*?lm loss: ([0-9.E+-]+)", log)]
    train = json.loads((out / "train.json").read_text())
    assert len(losses) == 7 and train["iterations"] == 30  # iteration 1, then every 5th
    assert (train["first_loss"], train["last_loss"]) == (losses[0], losses[-1])
    assert losses[-1] < 0.6 * losses[0]
    assert any(line.startswith("omnibal: pipeline: TP=1, PP=1, DP=2") for line in train["startup"])
    checkpoint = out / "finetune" / "checkpoints" / "train"
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
    finetune = json.loads((out / "finetune" / "report.json").read_text())
    assert finetune["compare_hf"]["ok"] and finetune["export"] == str(out / "finetune" / "hf")
    assert f"exported Hugging Face checkpoint {out / 'finetune' / 'hf'}, compare-hf passed" in (
        proc.stdout.split("== summary")[1])
    report = json.loads((out / "step_time.json").read_text())
    rows = {r["step"]: r for r in report["shapes"][0]["rows"]}
    assert set(rows) == {"baseline", "+recompute"}
    assert rows["baseline"]["samples_per_step"] == 4 * report["shapes"][0]["baseline_batch"]
    plan = json.loads((out / "step_time" / "6+20b" / "plan.json").read_text())
    assert len(rows["+recompute"]["stages"]) == len(plan["stages"]) == 2
    for name in ("gantt_omnibal.png", "gantt_baseline.png"):
        assert Image.open(out / name).format == "PNG"
    assert "not a benchmark" in proc.stdout
