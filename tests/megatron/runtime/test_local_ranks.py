"""megatron/runtime/local_ranks.py: ranks forked from one interpreter get what torchrun gives its
ranks (the oracle: the same program under `torchrun --standalone`), form a gloo group, and a
failing rank stops the others with its exit code, as under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_omnibal.megatron.runtime import local_ranks

PROGRAM = """
import json, os, sys
import torch
import torch.distributed as dist
out, mode = sys.argv[1], sys.argv[2]
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT",
         "TORCHELASTIC_MAX_RESTARTS", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
dist.init_process_group("gloo")
rank = dist.get_rank()
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode == "raise" and rank == 1:
    raise RuntimeError("rank 1 broke")
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)  # with a failed rank 1 this waits until the launcher stops it
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"env": {n: os.environ.get(n) for n in names}, "total": total.item(),
               "argv": sys.argv[1:], "path0": sys.path[0]}, f)
"""


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture()
def program(tmp_path: Path) -> Path:
    path = tmp_path / "prog" / "ranks.py"
    path.parent.mkdir()
    path.write_text(PROGRAM)
    return path


@pytest.mark.megatron
def test_forked_ranks_get_torchruns_environment_and_form_a_group(program, tmp_path):
    got = {}
    for name, cmd in (
        ("local", local_ranks.command(3, [str(program), str(tmp_path / "local"), "ok"])),
        ("torchrun", [sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc-per-node=3", str(program), str(tmp_path / "torchrun"), "ok"]),
    ):  # fmt: skip
        (tmp_path / name).mkdir()
        proc = _run(cmd)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[name] = [json.loads((tmp_path / name / f"rank{r}.json").read_text())
                     for r in range(3)]  # fmt: skip
    for local, real in zip(got["local"], got["torchrun"], strict=True):
        assert local["total"] == real["total"] == 6.0  # 1 + 2 + 3 over the gloo group
        assert local["argv"] == [str(tmp_path / "local"), "ok"]
        assert local["path0"] == real["path0"] == str(program.parent)
        same = {k: v for k, v in local["env"].items()
                if k not in ("MASTER_PORT", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")}
        assert same == {k: real["env"][k] for k in same}
        assert local["env"]["TORCHELASTIC_RUN_ID"] and local["env"]["MASTER_PORT"]
    assert len({r["env"]["TORCHELASTIC_RUN_ID"] for r in got["local"]}) == 1


@pytest.mark.megatron
@pytest.mark.parametrize("mode, code, message", [("fail", 3, None), ("raise", 1, "rank 1 broke")])
def test_a_failing_rank_stops_the_others_with_its_exit_code(program, tmp_path, mode, code,
                                                            message):
    start = time.monotonic()
    proc = _run(local_ranks.command(2, [str(program), str(tmp_path), mode]))
    assert proc.returncode == code, proc.stderr[-3000:]
    assert time.monotonic() - start < 120  # rank 0, left waiting in all_reduce, was stopped
    assert not list(tmp_path.glob("rank*.json"))
    if message:
        assert "Traceback" in proc.stderr and message in proc.stderr


@pytest.mark.parametrize("argv, error", [
    ([], "usage"), (["--nproc-per-node", "2"], "usage"), (["--nproc-per-node=x", "a.py"], "x"),
    (["--nproc-per-node=0", "a.py"], ">= 1"), (["--nproc-per-node=2", "-m"], "usage"),
])  # fmt: skip
def test_a_bad_command_line_is_refused(argv, error):
    with pytest.raises(ValueError, match=error):
        local_ranks.parse(argv)


def test_the_command_line_parses_back():
    cmd = local_ranks.command(4, ["-m", "pkg.mod", "--flag", "-m", "x"])
    assert cmd[:3] == [sys.executable, "-m", local_ranks.__name__]
    assert local_ranks.parse(cmd[3:]) == (4, "pkg.mod", None, ["--flag", "-m", "x"])
    assert local_ranks.parse(["--nproc-per-node", "2", "w.py", "-m"]) == (2, None, "w.py", ["-m"])
