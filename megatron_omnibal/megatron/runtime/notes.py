"""Transformer Engine / Apex fallback notes: once per run instead of once per module and rank.

Why: without Transformer Engine or Apex, megatron-core warns from every module that falls back
to its torch implementation (norms, optimizers, multi-tensor ops, MoE experts), on every rank:
a dozen lines per process that say one thing. The run says it once, on rank 0, and whether it
matters (a GPU run without them is slower; a CPU run cannot have them).
"""

from __future__ import annotations

import importlib.util
import os
import warnings

from megatron_omnibal.megatron.runtime.stderr import write_line

# megatron-core 0.19's fallback warnings (matched at the start of the message, any case).
FALLBACK_MESSAGES = (
    "Apex is not installed",
    "Transformer Engine and Apex are not installed",
    "Only transformer-engine>=",
)


def quiet_fallback_warnings() -> None:
    """Silence megatron-core's per-module fallback warnings (call before Megatron imports)."""
    for message in FALLBACK_MESSAGES:
        warnings.filterwarnings("ignore", message=message)


def missing_accelerators() -> list[str]:
    """The optional accelerators that do not import here."""
    names = {"Transformer Engine": "transformer_engine", "Apex": "apex"}
    return [label for label, module in names.items() if importlib.util.find_spec(module) is None]


def note_fallbacks() -> None:
    """Rank 0 says once which accelerators are missing (nothing when both are installed)."""
    missing = missing_accelerators()
    if not missing or int(os.environ.get("RANK", "0")) != 0:
        return
    write_line(
        f"pretrain_vlm: note: {' and '.join(missing)} not installed: Megatron uses its local "
        "(torch) layers, norms, optimizer and multi-tensor ops instead"
    )
