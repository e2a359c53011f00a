"""Two functions of megatron.training replaced in place, once per process.

Why: megatron.training is used as it ships, but two of its steps do not fit a run here. Its
initialize builds a C++ helper with `make` from a Makefile the megatron-core wheel does not
ship; and its loop runs every step with one run-wide micro-batch count, where a step of a
packing level runs that level's count. Each replacement is marked `__omnibal__` so a second
call (a test's second run in one process) leaves it as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def skip_runtime_helper_build() -> None:
    """megatron/training/initialize.py _compile_dependencies() runs `make` in
    megatron/core/datasets (core/datasets/utils.py compile_helpers). The megatron-core wheel
    ships that extension prebuilt (helpers_cpp) but no Makefile, so `make` fails and the run
    exits, on GPUs as on CPUs. Skip the build when the built module imports (a Megatron-LM
    checkout with its Makefile keeps building as before). These runs use no Megatron dataset."""
    from megatron.core.datasets import utils

    if getattr(utils.compile_helpers, "__omnibal__", False):
        return
    orig = utils.compile_helpers

    def compile_helpers() -> None:
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            orig()

    compile_helpers.__omnibal__ = True  # type: ignore[attr-defined]
    utils.compile_helpers = compile_helpers


def wrap_forward_backward_func(wrap: Callable[[Any], Any]) -> None:
    """megatron.training's loop gets `wrap(schedule)` wherever it asks
    get_forward_backward_func() for its pipeline schedule (once per process)."""
    import megatron.training.training as loop

    if getattr(loop.get_forward_backward_func, "__omnibal__", False):
        return
    get = loop.get_forward_backward_func

    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
        return wrap(get(*args, **kwargs))

    get_forward_backward_func.__omnibal__ = True  # type: ignore[attr-defined]
    loop.get_forward_backward_func = get_forward_backward_func
