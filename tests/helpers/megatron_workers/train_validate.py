"""Run megatron_omnibal's entry point on several bad command lines in ONE process (WORLD_SIZE
from the environment, no torchrun) and report, per case, the exit status, the error printed and
whether a process group exists afterwards (it must not: validation comes first).

Usage: WORLD_SIZE=N python train_validate.py CASES.json OUT.json
CASES.json: [[flag, ...], ...]; OUT.json: [{"status", "error", "notes", "process_group"}, ...]
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron
from megatron_omnibal.megatron.training.pretrain_vlm import main

enable_cpu_megatron()  # on CPU-only torch: before megatron.training imports (Python 3.11)

import torch.distributed as dist  # noqa: E402
from megatron.training.global_vars import unset_global_variables  # noqa: E402


def run_case(argv: list[str]) -> dict:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = main(argv)
    unset_global_variables()
    lines = err.getvalue().splitlines()
    return {"status": status, "process_group": dist.is_initialized(),
            "error": [x for x in lines if x.startswith("pretrain_vlm: error:")],
            "notes": [x for x in lines if x.startswith("pretrain_vlm: note:")]}  # fmt: skip


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps([run_case(c) for c in cases]))
