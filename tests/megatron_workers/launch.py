"""Run a worker under torchrun for the Megatron tests, and never leave processes behind.

torchrun's workers outlive a killed torchrun; on a timeout the whole process group (torchrun and
its workers) is killed before the error is raised.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path


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
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return -9, out, f"timed out after {timeout} s\n{err}"
    return proc.returncode, out, err
