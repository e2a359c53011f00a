"""The entry points of a patched Megatron-LM pretrain_vlm.py (patches/*-omnibal.patch).

Why a module of its own: the patch is a few lines in another project's file and should stay
that way; everything that may change with the package lives here. The script, run with any
--omnibal* flag, calls `run()` instead of its own training. Processes that re-import the
script under another module name also see the --omnibal* flags (multiprocessing's "spawn"
start method, e.g. the manager process of the torch_dist checkpoint writer, imports the main
script as `__mp_main__` with the parent's sys.argv): they must not train, but the rest of the
script, which imports the checkout's Megatron, must import as it did in the training process;
`prepare_reimport()` gives them the same set-up.
"""

from __future__ import annotations


def run() -> int:
    """Train with megatron-omnibal (the patched script exits with this status)."""
    from megatron_omnibal.megatron.training.pretrain_vlm import main

    return main()


def prepare_reimport() -> None:
    """Make the patched script's Megatron imports work in a helper process, as main() does in
    the training processes: typing.override on Python 3.11 and, on a CPU-only torch, the CPU
    layer."""
    from megatron_omnibal.megatron.runtime.compat import ensure_typing_override
    from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron

    ensure_typing_override()
    enable_cpu_megatron()
