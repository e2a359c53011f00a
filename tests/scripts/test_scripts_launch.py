"""scripts/launch_single_node.sh and launch_multi_node.sh: the torchrun command they build
(--dry-run, compared with the command written out here from torchrun's documented flags) and a
real two-node rendezvous on this machine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_omnibal.megatron.runtime.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SINGLE = ROOT / "scripts" / "launch_single_node.sh"
MULTI = ROOT / "scripts" / "launch_multi_node.sh"
ENTRY = ["-m", "megatron_omnibal.pretrain_vlm"]
CPU_ENV = ["env", "OMP_NUM_THREADS=1", "TORCHDYNAMO_DISABLE=1", "CUDA_VISIBLE_DEVICES="]
GLOO = ["--distributed-backend", "gloo"]
# Variables the launchers read; the tests start from none of them.
LAUNCH_VARS = (
    "GPUS_PER_NODE",
    "NNODES",
    "NODE_RANK",
    "SLURM_NNODES",
    "SLURM_NODEID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RDZV_ENDPOINT",
    "RDZV_BACKEND",
    "RDZV_ID",
    "TORCHRUN",
    "OMP_NUM_THREADS",
    "TORCHDYNAMO_DISABLE",
)


def launch_env(**env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**base, **env}


def launch(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        env=launch_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def dry_run(script: Path, *args: str, **env: str) -> list[str]:
    """The command the launcher would run, as the argument list a shell would give exec."""
    result = launch(script, "--dry-run", *args, **env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    return shlex.split(lines[0])


def test_single_node_gpu_passes_flags_through_in_order() -> None:
    flags = ["--omnibal-plan", "my plan.json", "--tensor-model-parallel-size", "2", "--bf16"]
    got = dry_run(SINGLE, *flags, GPUS_PER_NODE="8")
    expected = ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "8"]
    assert got == expected + ENTRY + flags


def test_single_node_defaults_one_process_per_gpu_or_two_on_cpu() -> None:
    assert dry_run(SINGLE, "--lr", "1e-4")[5] == "gpu"
    got = dry_run(SINGLE, "--cpu", "--lr", "1e-4")
    expected = ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "2"]
    assert got == CPU_ENV + expected + ENTRY + ["--lr", "1e-4"] + GLOO


def test_cpu_mode_keeps_explicit_backend_and_options_anywhere(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    got = dry_run(
        SINGLE,
        "--distributed-backend=gloo",
        "--cpu",
        "--script",
        str(script),
        "--nproc-per-node=3",
        "--omnibal",
        "--",
        "--cpu",
        "--dry-run",
        TORCHRUN="python -m torch.distributed.run",
        OMP_NUM_THREADS="4",
    )
    env = ["env", "OMP_NUM_THREADS=4", "TORCHDYNAMO_DISABLE=1", "CUDA_VISIBLE_DEVICES="]
    launcher = ["python", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1"]
    args = ["--distributed-backend=gloo", "--omnibal", "--cpu", "--dry-run"]
    assert got == env + launcher + ["--nproc-per-node", "3", str(script)] + args


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("import megatron\n", "is not patched for --omnibal"),
        (
            "from megatron_omnibal.megatron.training.pretrain_vlm import main\n",
            "an older megatron-omnibal",
        ),
    ],
)
def test_an_unpatched_megatron_lm_script_with_omnibal_flags_is_refused(
    tmp_path: Path, content: str, message: str
) -> None:
    """Megatron-LM's pretrain_vlm.py without the current patch would fail on --omnibal with an
    error that does not say why; the launcher names the patch. Without --omnibal* flags, or
    patched, it runs."""
    script = tmp_path / "Megatron-LM" / "pretrain_vlm.py"
    script.parent.mkdir()
    script.write_text(content)
    for launcher in (SINGLE, MULTI):
        result = launch(launcher, "--dry-run", "--script", str(script), "--omnibal",
                        NNODES="1", MASTER_ADDR="127.0.0.1")  # fmt: skip
        assert result.returncode == 2
        assert message in result.stderr
        assert f"scripts/apply_megatron_patch.sh {script.parent}" in result.stderr
    assert dry_run(SINGLE, "--script", str(script), "--lr", "1")[-3:] == [str(script), "--lr", "1"]
    script.write_text("from megatron_omnibal.megatron.training import handover\n")
    assert dry_run(SINGLE, "--script", str(script), "--omnibal")[-1] == "--omnibal"


def test_module_runs_a_module_with_the_same_flags() -> None:
    """--module megatron_omnibal.preflight: the preflight of the training's flags."""
    for launcher in (SINGLE, MULTI):
        got = dry_run(launcher, "--module", "megatron_omnibal.preflight", "--lr", "1",
                      NNODES="1", MASTER_ADDR="127.0.0.1")  # fmt: skip
        assert got[-4:] == ["-m", "megatron_omnibal.preflight", "--lr", "1"]


def test_multi_node_static_rendezvous_from_master_addr() -> None:
    got = dry_run(
        MULTI,
        "--omnibal-plan",
        "plan.json",
        NNODES="4",
        NODE_RANK="3",
        MASTER_ADDR="10.1.2.3",
        MASTER_PORT="6000",
        GPUS_PER_NODE="8",
    )
    expected = ["torchrun", "--nnodes", "4", "--node-rank", "3", "--nproc-per-node", "8"]
    rdzv = ["--rdzv-backend", "static", "--rdzv-endpoint", "10.1.2.3:6000"]
    assert got == expected + rdzv + ENTRY + ["--omnibal-plan", "plan.json"]


def test_multi_node_flags_override_environment_and_endpoint_wins() -> None:
    got = dry_run(
        MULTI,
        "--nnodes",
        "2",
        "--node-rank=1",
        "--cpu",
        NNODES="8",
        NODE_RANK="5",
        MASTER_ADDR="ignored",
        RDZV_ENDPOINT="head:29400",
    )
    expected = ["torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2"]
    rdzv = ["--rdzv-backend", "static", "--rdzv-endpoint", "head:29400"]
    assert got == CPU_ENV + expected + rdzv + ENTRY + GLOO


def test_multi_node_defaults_port_and_reads_slurm() -> None:
    got = dry_run(MULTI, SLURM_NNODES="3", SLURM_NODEID="2", MASTER_ADDR="head")
    expected = ["torchrun", "--nnodes", "3", "--node-rank", "2", "--nproc-per-node", "gpu"]
    assert got == expected + ["--rdzv-backend", "static", "--rdzv-endpoint", "head:29500"] + ENTRY


def test_multi_node_elastic_c10d_rendezvous() -> None:
    got = dry_run(
        MULTI, NNODES="2", RDZV_BACKEND="c10d", RDZV_ENDPOINT="head:29400", RDZV_ID="job7"
    )
    expected = ["torchrun", "--nnodes", "2", "--nproc-per-node", "gpu", "--rdzv-backend", "c10d"]
    assert got == expected + ["--rdzv-endpoint", "head:29400", "--rdzv-id", "job7"] + ENTRY


@pytest.mark.parametrize(
    ("script", "args", "env", "message"),
    [
        (SINGLE, ["--nnodes", "2"], {}, "--nnodes is for several nodes"),
        (SINGLE, ["--nproc-per-node"], {}, "--nproc-per-node needs a value"),
        (SINGLE, ["--nproc-per-node", "0"], {}, "must be at least 1, got '0'"),
        (SINGLE, [], {"GPUS_PER_NODE": "eight"}, "must be a whole number, got 'eight'"),
        (SINGLE, ["--script", "/no/such.py"], {}, "--script: no such file: /no/such.py"),
        (SINGLE, ["--script", "x.py", "--module", "m"], {}, "--script and --module: give one"),
        (MULTI, [], {"MASTER_ADDR": "h", "NODE_RANK": "0"}, "number of nodes unknown"),
        (MULTI, ["--nnodes", "2"], {"MASTER_ADDR": "h"}, "node rank unknown"),
        (MULTI, ["--nnodes", "2", "--node-rank", "2"], {"MASTER_ADDR": "h"}, "out of range"),
        (MULTI, ["--nnodes", "2", "--node-rank", "0"], {}, "rendezvous endpoint unknown"),
        (MULTI, ["--nnodes", "1"], {"RDZV_ENDPOINT": "head"}, "must be host:port, got 'head'"),
        (MULTI, ["--nnodes", "1"], {"RDZV_BACKEND": "etcd"}, "must be static or c10d"),
    ],
)
def test_bad_input_is_refused_with_a_reason(
    script: Path, args: list[str], env: dict[str, str], message: str
) -> None:
    result = launch(script, "--dry-run", *args, **env)
    assert result.returncode == 2
    assert result.stdout == ""
    assert message in result.stderr


def test_help_lists_the_options() -> None:
    for script in (SINGLE, MULTI):
        result = launch(script, "--help")
        assert result.returncode == 0
        assert "--nproc-per-node" in result.stdout and "--dry-run" in result.stdout
    assert "MASTER_ADDR" in launch(MULTI, "--help").stdout


def test_local_ranks_takes_the_single_node_launch_and_refuses_several_nodes() -> None:
    """local_ranks as $TORCHRUN (how the tests run the workflow's CPU launches): it reads the
    command line each launcher builds for one node as torchrun would (processes, program, its
    flags in order); several nodes it refuses, naming why."""
    from megatron_omnibal.megatron.runtime import local_ranks

    torchrun = f"python -m {local_ranks.__name__}"
    flags = ["--lr", "1", "--", "-m", "x"]
    expected = (3, "megatron_omnibal.pretrain_vlm", None, ["--lr", "1", "-m", "x", *GLOO])
    one_node = [
        (SINGLE, {}),
        (MULTI, {"NNODES": "1", "MASTER_ADDR": "127.0.0.1"}),
        (MULTI, {"NNODES": "1", "RDZV_BACKEND": "c10d", "RDZV_ENDPOINT": "h:1", "RDZV_ID": "j"}),
    ]
    for script, env in one_node:
        got = dry_run(script, "--cpu", "--nproc-per-node", "3", *flags, TORCHRUN=torchrun, **env)
        launcher = ["python", "-m", local_ranks.__name__]
        assert got[: len(CPU_ENV) + 3] == CPU_ENV + launcher
        assert local_ranks.parse(got[len(CPU_ENV) + 3 :]) == expected, got
    got = dry_run(MULTI, "--cpu", *flags, TORCHRUN=torchrun, NNODES="2", NODE_RANK="1",
                  MASTER_ADDR="h")  # fmt: skip
    with pytest.raises(ValueError, match="--nnodes 2: local_ranks runs one node"):
        local_ranks.parse(got[len(CPU_ENV) + 3 :])
    for argv, message in (
        (["--node-rank=1", "--nproc-per-node=2", "a.py"], "--node-rank 1: local_ranks runs one"),
        (["--max-restarts", "3", "--nproc-per-node=2", "a.py"], "--max-restarts: not an option"),
        (["--nproc-per-node", "2", "--rdzv-id"], "--rdzv-id needs a value"),
    ):
        with pytest.raises(ValueError, match=message):
            local_ranks.parse(argv)
    assert local_ranks.parse(["--nproc_per_node=2", "--standalone", "w.py", "--nnodes", "2"]) == (
        2, None, "w.py", ["--nnodes", "2"])  # fmt: skip


PROBE = """
import json, os, sys
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
print(json.dumps({"env": {k: os.environ[k] for k in keys}, "argv": sys.argv[1:]}), flush=True)
"""


def test_two_nodes_meet_at_the_rendezvous(tmp_path: Path) -> None:
    """Two launcher processes as two nodes of one job: torchrun's static rendezvous on
    MASTER_ADDR:MASTER_PORT gives each worker its global rank from --node-rank."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = launch_env(
        TORCHRUN=torchrun, NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    args = ["bash", str(MULTI), "--cpu", "--nproc-per-node", "1", "--script", str(probe), "--x"]
    nodes = [
        subprocess.Popen(
            args,
            env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        # A few seconds on idle cores; the margin is for a loaded machine.
        outputs = [node.communicate(timeout=180) for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.terminate()  # torchrun stops its workers on SIGTERM
        said = [node.communicate(timeout=30) for node in nodes]
        pytest.fail("the two nodes did not finish in 180 s; what each printed:\n"
                    + "\n".join(f"node {r}:\n{out}{err}" for r, (out, err) in enumerate(said)))
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err
    for rank, (out, _) in enumerate(outputs):
        report = json.loads(out.strip().splitlines()[-1])
        assert report["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
            "GROUP_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
        }
        assert report["argv"] == ["--x", *GLOO]


@pytest.mark.megatron
def test_single_node_cpu_trains_a_pipeline(tmp_path: Path) -> None:
    """launch_single_node.sh --cpu with the package's entry: 2 gloo processes train a tiny VLM at
    PP=2 for 3 steps and each pipeline stage writes its own checkpoint shard."""
    import numpy as np

    from megatron_omnibal.data.lengths import load_lengths, read_stats_config, save_lengths

    real = load_lengths(ROOT / "examples" / "data" / "internvl_subset.npz")
    lengths = tmp_path / "lengths.npz"
    counted = read_stats_config(ROOT / "examples" / "data" / "internvl_subset.npz")
    save_lengths(real.subset(np.arange(0, len(real), len(real) // 40)[:40]), lengths,
                 config=counted)
    flags = [
        "--omnibal", "--omnibal-model", "tiny", "--omnibal-lengths", str(lengths),
        "--omnibal-vit-budget", "16", "--omnibal-token-budget", "160",
        "--omnibal-text-scale", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--pipeline-model-parallel-size", "2", "--omnibal-vit-pp-layers", "4,0",
        "--omnibal-llm-pp-layers", "1,3", "--lr", "1e-3", "--clip-grad", "0",
        "--transformer-impl", "local", "--ckpt-format", "torch", "--log-interval", "1",
        "--train-iters", "3", "--save", str(tmp_path / "ckpt"), "--save-interval", "100",
    ]  # fmt: skip
    torchrun = f"{sys.executable} -m torch.distributed.run"
    result = subprocess.run(
        ["bash", str(SINGLE), "--cpu", *flags],
        env=launch_env(TORCHRUN=torchrun),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,  # about 30 s on 2 idle cores; the margin is for a loaded machine
    )
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    for setting in ("world_size", "pipeline_model_parallel_size"):
        assert re.search(rf"^\s*{setting} \.+ 2$", log, re.MULTILINE), setting
    assert re.search(r"^\s*distributed_backend \.+ gloo$", log, re.MULTILINE)
    losses = [float(v) for v in re.findall(r"iteration +\d+/ +3 .*lm loss: ([0-9.E+-]+)", log)]
    assert len(losses) == 3 and all(np.isfinite(losses)), log[-3000:]
    step = tmp_path / "ckpt" / "iter_0000003"
    shards = sorted(p.parent.name for p in step.glob("*/model_optim_rng.pt"))
    assert shards == ["mp_rank_00_000", "mp_rank_00_001"]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
