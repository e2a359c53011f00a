"""Run a worker on local gloo ranks for the Megatron tests, and never leave processes behind.

By default the ranks are forked from one interpreter that imported torch and megatron-core once
(megatron/runtime/local_ranks.py, the launcher of the package's CPU tools): on this 2-core
machine the import is most of a small worker's CPU time. `torchrun=True` starts every rank as
a fresh interpreter under `torchrun --standalone`, for the checks that need a process nothing
was imported into. The training entry point keeps tests of its own under real torchrun.

torchrun's workers outlive a killed torchrun; on a timeout the launcher's process group and
every process it started are killed before the error is raised.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from megatron_omnibal.megatron.runtime import local_ranks


def run_ranks(
    worker: Path, nproc: int, args: list[str], timeout: float, env: dict[str, str] | None = None,
    *, torchrun: bool = False,
) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of `worker args` on `nproc` local ranks (`env`: extra
    environment variables)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", **(env or {})}
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", str(worker), *args]  # fmt: skip
    else:
        cmd = local_ranks.command(nproc, [str(worker), *args])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun's workers may run in sessions of their own: kill them by ancestry too, or one
        # left alive keeps the pipes open and the test waits forever.
        workers = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for worker_proc in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker_proc.kill()
        out, err = proc.communicate(timeout=60)
        return -9, out, f"timed out after {timeout} s\n{err}"
    return proc.returncode, out, err
