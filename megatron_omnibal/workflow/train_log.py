"""Figures read back from a training log: per logged iteration Megatron's loss and step time,
with the OmniBal balance figures of the same iteration, and the start-up summary.

The finetune report and `make demo` both read logs with this one parser.
"""

from __future__ import annotations

import re
import statistics

MEGATRON_LINE = re.compile(
    r"\biteration +(\d+)/ *\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+).*?"
    r"lm loss: ([0-9.E+-]+)"
)
OMNIBAL_LINE = re.compile(
    r"omnibal: iteration +(\d+) \| samples/step ([0-9.]+) \| tiles/step ([0-9.]+) \| "
    r"tokens/step ([0-9.]+) \| per-rank tokens .*?\(max/mean ([0-9.]+)\) \| "
    r"per-rank tiles .*?\(max/mean ([0-9.]+)\)"
)


def parse_train_log(text: str) -> dict:
    """{"startup": rank 0's start-up lines, "rows": one dict per logged iteration, in order}.
    An iteration logged twice (a resumed run repeats the steps after its last checkpoint)
    keeps its last figures."""
    steps: dict[int, dict] = {}
    for m in MEGATRON_LINE.finditer(text):
        steps.setdefault(int(m[1]), {}).update(ms=float(m[2]), loss=float(m[3]))
    for m in OMNIBAL_LINE.finditer(text):
        steps.setdefault(int(m[1]), {}).update(
            samples=float(m[2]),
            tiles=float(m[3]),
            tokens=float(m[4]),
            tokens_max_over_mean=float(m[5]),
            tiles_max_over_mean=float(m[6]),
        )
    startup = [line for line in text.splitlines() if line.startswith("omnibal: ")]
    rows = [{"iteration": k, **v} for k, v in sorted(steps.items())]
    return {"startup": startup, "rows": rows}


def measured_step_ms(rows: list[dict]) -> float | None:
    """Median logged step time, the first logged figure left out (start-up) when there are
    others."""
    times = [r["ms"] for r in rows if "ms" in r]
    if len(times) > 1:
        times = times[1:]
    return statistics.median(times) if times else None
