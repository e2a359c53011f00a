"""`omnibal finetune` on CPU, as a user runs it: a tiny transformers InternVL with its own
tokenizer, a generated InternVL dataset of real JPEG/PNG files, PP=2 on 2 gloo processes.

One module-wide run does all seven steps; later tests build on its output directory (a second
run skips everything; a changed learning rate reruns training and what follows, killed and
resumed). The export is checked by transformers itself (compare-hf's oracle, and loading it
here), the iteration counts by Megatron's own checkpoint tracker and log.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from megatron_omnibal.data.formats.generate import qa_dataset
from megatron_omnibal.megatron.runtime.ports import free_port
from megatron_omnibal.models.tiny_hf import write_tiny_internvl
from tests.helpers.finetune_runs import (  # noqa: E402
    ITERS,
    ROOT,
    STEPS,
    TORCHRUN,
    finetune,
    run_env,
    step_status,
    write_config,
)

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def _tracker(folder: Path) -> str:
    return (folder / "out/checkpoints/train/latest_checkpointed_iteration.txt").read_text()


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("finetune")
    made = qa_dataset(folder / "data", samples=160, images=41, seed=2)
    write_tiny_internvl(folder / "hf", made.tokenizer)
    config = write_config(folder, "run.yaml", preflight={"typical_steps": 1})
    proc = finetune(config, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder, config, proc


def test_all_seven_steps_run_and_report(first_run):
    from transformers import InternVLForConditionalGeneration

    folder, _, proc = first_run
    out = folder / "out"
    assert step_status(proc.stdout) == dict.fromkeys(STEPS, "ran")
    for step in STEPS:
        assert (out / "logs" / f"{step}.log").stat().st_size > 0
    assert _tracker(folder) == str(ITERS)
    report = json.loads((out / "report.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert report["plan"]["predicted_step_ms"] == plan["predicted"]["step_ms"]
    assert (report["plan"]["pp"], report["plan"]["dp"]) == (2, 1)
    logged = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)",
                                           (out / "logs" / "train.log").read_text())]  # fmt: skip
    assert len(logged) == ITERS and min(logged) <= report["train"]["measured_step_ms"]
    assert report["train"]["iteration"] == ITERS
    preflight = json.loads((out / "preflight.json").read_text())  # the step before training
    assert report["preflight"]["ok"] and preflight["ok"]
    assert preflight["step_ms"]["planned"] == plan["predicted"]["step_ms"]
    assert report["compare_hf"]["ok"] and report["compare_hf"]["max_rel"] < 1e-4
    for png in ("loss.png", "balance.png", "stats.png"):
        assert Image.open(out / png).format == "PNG"
    assert report["export"] == str(out / "hf")
    # the export is the trained model: transformers loads it, and training changed it
    trained = InternVLForConditionalGeneration.from_pretrained(out / "hf")
    start = InternVLForConditionalGeneration.from_pretrained(folder / "hf")
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    assert not trained.state_dict()[name].equal(start.state_dict()[name])
    text = (out / "report.md").read_text()
    assert "compare-hf: passed" in text and str(out / "hf") in text and text in proc.stdout
    # a device: cpu trial: the GPU plan's prediction is not compared with a CPU step
    assert report["step_time"]["ratio"] is None and "measured/predicted" not in text
    assert "a different device: not compared" in text


def test_a_second_run_skips_every_step(first_run):
    folder, config, _ = first_run
    report = ("report.md", "report.json", "loss.png")  # rewritten by every run
    before = {p: p.stat().st_mtime_ns for p in (folder / "out").rglob("*") if p.is_file()
              and "logs" not in p.parts and p.name not in report}
    proc = finetune(config)
    assert proc.returncode == 0, proc.stderr
    assert step_status(proc.stdout) == dict.fromkeys(STEPS, "skipped")
    assert {p: p.stat().st_mtime_ns for p in before} == before
    dry = finetune(config, "--dry-run")
    assert dry.stdout.count("up to date, would skip") == len(STEPS)


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants at once, as a crashed machine stops them
    (torchrun's workers run in sessions of their own: a process group kill misses them)."""
    import psutil

    parent = psutil.Process(pid)
    for p in [parent, *parent.children(recursive=True)]:
        p.send_signal(signal.SIGKILL)


@pytest.fixture(scope="module")
def killed(first_run):
    """A new learning rate, stopped by killing every process of the run once a checkpoint of
    the new run is written and before the last one (its preflight turned off in the config)."""
    folder, _, _ = first_run
    config = write_config(folder, "lr.yaml", lr=5e-4, preflight=False)
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron_omnibal.cli", "finetune", str(config), "--until",
         "train"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=run_env(),
    )  # fmt: skip
    tracker = folder / "out/checkpoints/train/latest_checkpointed_iteration.txt"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if tracker.is_file() and tracker.read_text().strip() not in ("", str(ITERS)):
            _kill_tree(proc.pid)
            break
        time.sleep(0.05)
    stdout, _ = proc.communicate(timeout=60)
    return folder, config, stdout, int(tracker.read_text())


def test_a_new_learning_rate_reruns_training_but_not_the_statistics(killed):
    folder, _, stdout, stopped = killed
    assert "[preflight] off in the config (preflight: false), skipped" in stdout
    assert step_status(stdout) == {"stats": "skipped", "plan": "skipped", "convert": "skipped",
                               "train": "ran"}  # fmt: skip
    assert 2 <= stopped < ITERS
    # the earlier run's checkpoints were set aside, not resumed from
    previous = folder / "out/checkpoints/train.previous/latest_checkpointed_iteration.txt"
    assert previous.read_text() == str(ITERS)
    log = (folder / "out/logs/train.log").read_text()
    assert f"loaded checkpoint from {folder / 'out/checkpoints/start'}" in log
    assert f"loaded checkpoint from {folder / 'out/checkpoints/train'}" not in log
    assert (folder / "out/logs/train.log.previous").is_file()


def test_a_killed_run_resumes_from_its_last_checkpoint(killed):
    folder, config, _, stopped = killed
    proc = finetune(config, "--until", "train")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    status = step_status(proc.stdout)
    assert status == {"stats": "skipped", "plan": "skipped", "convert": "skipped",
                      "train": "ran"}  # fmt: skip
    assert f"training stopped at iteration {stopped} of {ITERS}" in proc.stdout
    log = (folder / "out/logs/train.log").read_text()
    resumed = log.split("=== omnibal finetune: train started")[-1]
    assert re.search(rf"loaded checkpoint from {folder / 'out/checkpoints/train'}.* at "
                     rf"iteration {stopped}\b", resumed)  # fmt: skip
    iterations = [int(i) for i in re.findall(r"\biteration +(\d+)/ *\d+ \|", resumed)]
    assert iterations == list(range(stopped + 1, ITERS + 1))
    assert _tracker(folder) == str(ITERS)
    # the export and verdict on disk are the first run's: the report leaves them out
    report = json.loads((folder / "out" / "report.json").read_text())
    assert report["train"]["iteration"] == ITERS
    assert report["export"] is None and report["compare_hf"] is None
    assert (folder / "out" / "compare_hf.json").is_file()


def test_several_nodes_get_one_launch_script_each_that_trains(killed):
    """Two nodes of one process each (PP=2 across them, a static rendezvous on this machine):
    the scripts run scripts/launch_multi_node.sh, the preflight then training, with real
    torchrun; run together they train to the end, and the next `omnibal finetune` takes the
    checkpoint as done."""
    folder, _, _, _ = killed
    iters = 4  # two checkpoints, as in the single-node runs; each step costs both real launches
    config = write_config(folder, "nodes.yaml", gpus_per_node=1, nodes=2, master_addr="127.0.0.1",
                          iters=iters, preflight={"typical_steps": 1})  # fmt: skip
    proc = finetune(config, "--until", "train", TORCHRUN=TORCHRUN)
    assert proc.returncode == 0, proc.stderr
    assert step_status(proc.stdout) == dict.fromkeys(("stats", "plan", "convert"), "skipped")
    assert "[preflight] several nodes: runs in the launch scripts, before training" in proc.stdout
    scripts = [folder / "out" / "launch" / f"node_{r}.sh" for r in (0, 1)]
    preflight = folder / "out" / "preflight.json"
    preflight.unlink()
    for rank, script in enumerate(scripts):
        text = script.read_text()
        check = text.index(f"launch_multi_node.sh --nnodes 2 --node-rank {rank} --cpu --module "
                           "megatron_omnibal.preflight")  # fmt: skip
        assert check < text.index(f"launch_multi_node.sh --nnodes 2 --node-rank {rank} --cpu "
                                  "--nproc-per-node")  # fmt: skip
        assert f"--omnibal-plan {folder / 'out' / 'plan.json'}" in text
        assert f"export TORCHRUN='{TORCHRUN}'" in text
        assert os.access(script, os.X_OK)
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    nodes = [subprocess.Popen(["bash", str(s)], env=env) for s in scripts]
    assert [p.wait(timeout=400) for p in nodes] == [0, 0]
    assert json.loads(preflight.read_text())["ok"]  # node 0's rank 0 wrote it
    assert _tracker(folder) == str(iters)
    assert f"iteration {iters:8d}/{iters:8d}" in (folder / "out/logs/train.node1.log").read_text()
    proc = finetune(config, "--until", "train")
    assert proc.returncode == 0 and step_status(proc.stdout)["train"] == "skipped", proc.stdout
