"""torchrun worker: run megatron_omnibal's training entry point and count, on this rank, the
start-up work that should happen once: epoch plans balanced, plan.json files read, layout
validations, data sources opened, length files read.

Usage: torchrun --nproc-per-node N startup_counts.py OUT_DIR <Megatron and --omnibal flags>
Writes OUT_DIR/counts_rank{R}.json ({"rank", "local_rank", name: calls}) when the process
exits, also after a stop by --exit-interval. The counters wrap the functions where they are
defined and every module-level name already bound to them, before the entry point runs.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

COUNTED = {  # counter: (module, function)
    "epoch_plans_balanced": ("megatron_omnibal.balance.balancer", "balance"),
    "plan_json_reads": ("megatron_omnibal.planner.plan_file.plan", "load_plan"),
    "layout_validations": ("megatron_omnibal.megatron.stages.layout", "validate_layout"),
    "data_sources_opened": ("megatron_omnibal.megatron.stream.dataset", "open_source"),
    "length_file_reads": ("megatron_omnibal.data.lengths", "load_lengths"),
    "record_indexes_built": ("megatron_omnibal.megatron.stream.record_index", "RecordIndex.build"),
}
COUNTS: Counter = Counter({name: 0 for name in COUNTED})


def _counting(name, fn):
    def counted(*args, **kwargs):
        COUNTS[name] += 1
        return fn(*args, **kwargs)

    return counted


def install_counters() -> None:
    importlib.import_module("megatron_omnibal.megatron.training.pretrain_vlm")
    for name, (module, attr) in COUNTED.items():
        if "." in attr:  # a class's method, replaced on the class
            owner, method = attr.split(".")
            cls = getattr(importlib.import_module(module), owner)
            setattr(cls, method, staticmethod(_counting(name, getattr(cls, method))))
            continue
        original = getattr(importlib.import_module(module), attr)
        wrapper = _counting(name, original)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("megatron_omnibal") and getattr(
                mod, attr, None
            ) is original:
                setattr(mod, attr, wrapper)
        for mod in list(sys.modules.values()):  # imported under another name (`as`)
            if getattr(mod, "__name__", "").startswith("megatron_omnibal"):
                for key, value in list(vars(mod).items()):
                    if value is original:
                        setattr(mod, key, wrapper)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))

    def write() -> None:
        doc = {"rank": rank, "local_rank": int(os.environ.get("LOCAL_RANK", "0")), **COUNTS}
        (out / f"counts_rank{rank}.json").write_text(json.dumps(doc))

    atexit.register(write)
    install_counters()
    from megatron_omnibal.megatron.training.pretrain_vlm import main as train

    return train(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
