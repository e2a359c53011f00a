"""Python-version shims that importing megatron.training needs (the CPU layer is cpu.py).

Why: megatron/training/models/gpt.py and hybrid.py do `from typing import override`, which
exists from Python 3.12 on; the rest of megatron-core 0.19 (the wheel, and a Megatron-LM
checkout of that version) runs on 3.11, where the same decorator lives in typing_extensions.
Every process that imports megatron.training needs it: the training ranks, and helper processes
that re-import a patched Megatron-LM pretrain_vlm.py (megatron/training/handover.py).
"""

from __future__ import annotations

import typing


def ensure_typing_override() -> None:
    """Provide typing.override on Python < 3.12 (a no-op where it exists)."""
    if not hasattr(typing, "override"):
        from typing_extensions import override

        typing.override = override  # type: ignore[attr-defined]
