"""Run a worker on local gloo ranks for the Megatron tests, and never leave processes behind.

By default the ranks are forked by megatron/runtime/local_ranks.py's launcher, itself forked from
rank_server.py: one interpreter per pytest process that imported torch, megatron-core and the
training stack once (on this 2-core machine those imports are most of a small worker's CPU
time). `fresh=True` runs local_ranks' launcher as a process of its own, for the checks that
read what its imports print; `torchrun=True` starts every rank as a fresh interpreter under
`torchrun --standalone`, for the checks that need a process nothing was imported into. The
training entry point keeps tests of its own under real torchrun.

torchrun's workers outlive a killed torchrun; on a timeout the launcher's process group and
every process it started are killed before the error is raised.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from megatron_omnibal.megatron.runtime import local_ranks

SERVER = Path(__file__).resolve().with_name("rank_server.py")
BASE_ENV = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid`'s process group and every process it started (torchrun's workers may run
    in sessions of their own: left alive, one keeps the pipes open and the test waits forever)."""
    try:
        workers = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        workers = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    for worker_proc in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker_proc.kill()


class _RankServer:
    """The pytest process's rank_server.py, started at its first launch."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.buffer = b""

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(SERVER)], env={**os.environ,
                                         **BASE_ENV}, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, bufsize=0)  # fmt: skip
            self.buffer = b""
            atexit.register(self._stop, self.proc)
        return self.proc

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        """At the end of its input the server exits; waited for, so no process is left."""
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _answer(self, deadline: float | None) -> dict | None:
        """The server's next line; None when `deadline` (time.monotonic()) passes first."""
        while b"\n" not in self.buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], wait)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"rank server exited with {self.proc.wait()}")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, nproc: int, program: list[str], env: dict[str, str], timeout: float,
            cwd: str) -> tuple[int, str, str]:
        with self.lock, tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            proc = self._started()
            request = {"nproc": nproc, "program": program, "env": env, "cwd": cwd,
                       "stdout": str(out), "stderr": str(err)}  # fmt: skip
            proc.stdin.write((json.dumps(request) + "\n").encode())
            pid = self._answer(None)["pid"]
            answer = self._answer(time.monotonic() + timeout)
            if answer is None:
                _kill_tree(pid)
                self._answer(None)
                return -9, out.read_text(), f"timed out after {timeout} s\n{err.read_text()}"
            return answer["code"], out.read_text(), err.read_text()


_SERVER = _RankServer()


def run_local(
    nproc: int, program: list, timeout: float, env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """`program` (SCRIPT ARGS... or -m MODULE ARGS..., as local_ranks takes it) on `nproc`
    local ranks forked by local_ranks from the rank server: its exit status and output as a
    process's (`env`: extra environment variables)."""
    env = {**os.environ, **BASE_ENV, **(env or {})}
    program = [str(a) for a in program]
    code, out, err = _SERVER.run(nproc, program, env, timeout, str(cwd or os.getcwd()))
    return subprocess.CompletedProcess(program, code, out, err)


def run_ranks(
    worker: Path, nproc: int, args: list[str], timeout: float, env: dict[str, str] | None = None,
    *, torchrun: bool = False, fresh: bool = False,
) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of `worker args` on `nproc` local ranks (`env`: extra
    environment variables). `fresh=True`: local_ranks' launcher as a process of its own, which
    imports torch and megatron-core itself (its import-time output in the run's)."""
    if not (torchrun or fresh):
        proc = run_local(nproc, [worker, *args], timeout, env)
        return proc.returncode, proc.stdout, proc.stderr
    env = {**os.environ, **BASE_ENV, **(env or {})}
    program = [str(worker), *map(str, args)]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *program]  # fmt: skip
    else:
        cmd = local_ranks.command(nproc, program)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        out, err = proc.communicate(timeout=60)
        return -9, out, f"timed out after {timeout} s\n{err}"
    return proc.returncode, out, err
