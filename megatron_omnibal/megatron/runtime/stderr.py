"""One line to stderr in one write.

Why: every rank of a job writes to the same stream, and `print` writes the text and its newline
separately, so two ranks' lines could run together (and a line that starts with
"pretrain_vlm: error:" could be lost inside another). A single write of a line shorter than the
pipe's atomic size (4096 bytes) is never split.
"""

from __future__ import annotations

import sys


def write_line(text: str) -> None:
    """Write `text` and a newline to stderr in one call, then flush."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()
