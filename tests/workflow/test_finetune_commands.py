"""`omnibal finetune` without Megatron: what --dry-run prints, and a failing step's message."""

import re

from megatron_omnibal.data.formats.generate import qa_dataset
from tests.helpers.finetune_runs import STEPS, finetune, step_status, write_config  # noqa: E402


def test_dry_run_lists_every_command_and_runs_nothing(tmp_path):
    made = qa_dataset(tmp_path / "data", samples=40, images=11)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    config = write_config(tmp_path, "run.yaml", tp=1, template="qwen2_vl")
    proc = finetune(config, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert step_status(proc.stdout) == {}
    lines = dict(re.findall(r"^\[([a-z-]+)\] would run; log .*\n  (.*)$", proc.stdout, re.M))
    assert list(lines) == list(STEPS)
    assert f"stats {made.meta} --model {tmp_path / 'hf'}" in lines["stats"]
    assert "--template qwen2_vl" in lines["stats"]
    assert "plan " in lines["plan"] and "--tp 1 --pp 2" in lines["plan"]
    assert "convert hf-to-megatron" in lines["convert"]
    assert "launch_single_node.sh --cpu --nproc-per-node 2 -- --omnibal" in lines["train"]
    assert "--lr 0.001" in lines["train"] and lines["train"].endswith("--num-workers 1")
    assert "convert megatron-to-hf" in lines["export"] and "compare-hf" in lines["compare-hf"]
    assert not (tmp_path / "out").exists()


def test_a_failing_step_names_itself_and_its_log(tmp_path):
    """A model directory whose config.json is no VLM's: `omnibal stats` refuses it."""
    qa_dataset(tmp_path / "data", samples=40, images=11)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    proc = finetune(write_config(tmp_path, "run.yaml"))
    log = tmp_path / "out" / "logs" / "stats.log"
    assert proc.returncode == 1
    assert re.search(rf"step stats failed \(exit status \d\); its log: {log}", proc.stderr)
    assert "omnibal stats: error" in log.read_text()
    assert step_status(proc.stdout) == {"stats": "ran"}  # nothing after it


def test_with_node_rank_set_a_node_runs_its_part_of_training(tmp_path):
    """NODE_RANK and MASTER_ADDR (as a cluster scheduler sets them): this node's torchrun of
    the multi-node launcher; without them, several nodes get launch scripts instead."""
    qa_dataset(tmp_path / "data", samples=40, images=11)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    config = write_config(tmp_path, "run.yaml", nodes=2, gpus_per_node=4)
    proc = finetune(config, "--dry-run", NODE_RANK="1", MASTER_ADDR="10.0.0.1")
    assert proc.returncode == 0, proc.stderr
    train = re.search(r"^\[train\] would run; log (.*)\n  (.*)$", proc.stdout, re.M)
    assert train[1] == str(tmp_path / "out" / "logs" / "train.node1.log")
    assert "MASTER_ADDR=10.0.0.1" in train[2]
    assert "launch_multi_node.sh --nnodes 2 --node-rank 1 --cpu --nproc-per-node 4 --" in train[2]
    assert "--gpus 8" in proc.stdout  # the plan is for all nodes' GPUs
    proc = finetune(config, "--dry-run", NODE_RANK="2", MASTER_ADDR="10.0.0.1")
    assert proc.returncode == 2 and "NODE_RANK=2 is not a node rank of 2 nodes" in proc.stderr


def test_a_lora_run_trains_adapters_and_exports_both(tmp_path):
    qa_dataset(tmp_path / "data", samples=40, images=11)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    lora = {"rank": 16, "alpha": 32, "targets": ["linear_qkv", "vit.*"]}
    proc = finetune(write_config(tmp_path, "run.yaml", tp=1, lora=lora), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = dict(re.findall(r"^\[([a-z-]+)\] would run; log .*\n  (.*)$", proc.stdout, re.M))
    assert ("--omnibal-lora-rank 16 --omnibal-lora-alpha 32.0 --omnibal-lora-dropout 0.05 "
            "--omnibal-lora-targets 'linear_qkv,vit.*'"
            in lines["train"])  # fmt: skip
    assert f"--pretrained-checkpoint {tmp_path / 'out/checkpoints/start'}" in lines["train"]
    assert "--lora-rank 16 --lora-targets 'linear_qkv,vit.*'" in lines["plan"]
    assert f"--adapter-out {tmp_path / 'out/hf-adapter'}" in lines["export"]
    assert (f"--adapter {tmp_path / 'out/hf-adapter'} --base {tmp_path / 'hf'}"
            in lines["compare-hf"])  # fmt: skip
    trained = {**lora, "train": ["vit"]}  # the ViT in full and with adapters: no PEFT adapter
    proc = finetune(write_config(tmp_path, "run2.yaml", tp=1, lora=trained), "--dry-run")
    lines = dict(re.findall(r"^\[([a-z-]+)\] would run; log .*\n  (.*)$", proc.stdout, re.M))
    assert "--omnibal-lora-train vit" in lines["train"]
    assert "--adapter" not in lines["export"] and "--adapter" not in lines["compare-hf"]
