"""Ending a rank's process group before the interpreter exits.

Why: a gloo process group left to the interpreter's teardown is destroyed while its background
threads still run, and a rank can abort at exit ("terminate called without an active
exception") after its work succeeded, so torchrun reports a failure. Destroying it first is a
local operation on each rank: it waits for no other rank.
"""

from __future__ import annotations


def end_process_group() -> None:
    """Destroy torch.distributed's default process group (and Megatron's groups with it) when
    one exists."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
