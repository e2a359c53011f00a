"""Run a worker under torchrun for the Megatron tests, and never leave processes behind.

torchrun's workers outlive a killed torchrun; on a timeout torchrun's process group and every
process it started are killed before the error is raised.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil


def torchrun(
    worker: Path, nproc: int, args: list[str], timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """(returncode, stdout, stderr) of `torchrun --standalone --nproc-per-node N worker args`
    (`env`: extra environment variables)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(worker), *args]  # fmt: skip
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
