"""Lines that several ranks write to one stderr at once stay whole (megatron/runtime/stderr.py);
with print, whose newline is a second write, this test fails: lines run together."""

from __future__ import annotations

import os
import re
import subprocess
import sys

WRITER = """
import sys
from megatron_omnibal.megatron.runtime.stderr import write_line
rank = sys.argv[1]
for i in range(3000):
    write_line(f"pretrain_vlm: error: rank {rank} line {i} " + "x" * 600)
"""


def test_lines_of_four_processes_on_one_pipe_never_run_together():
    read, write = os.pipe()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(rank)], stderr=write)
             for rank in range(4)]  # fmt: skip
    os.close(write)
    with os.fdopen(read, "r") as stream:
        text = stream.read()
    assert all(p.wait(timeout=60) == 0 for p in procs)
    lines = text.splitlines()
    pattern = re.compile(r"pretrain_vlm: error: rank (\d) line (\d+) x{600}")
    matches = [pattern.fullmatch(line) for line in lines]
    assert all(matches), next(line[:80] for line, m in zip(lines, matches, strict=True) if not m)
    assert sorted((int(m[1]), int(m[2])) for m in matches) == [
        (r, i) for r in range(4) for i in range(3000)
    ]
