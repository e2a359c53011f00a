"""Rebuild Megatron's model-parallel groups between the cases of one worker process.

megatron-core's destroy_model_parallel forgets its groups but leaves most of them registered
with torch.distributed, each with its gloo threads and sockets alive. A worker that builds new
groups for every case then pays for all earlier ones: measured on 2 loaded cores, 50 cases of
tests/helpers/megatron_workers/hf_worker.py took 650 s of CPU (mostly system time) instead of 38 s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.distributed as dist


def reset_model_parallel() -> None:
    """Destroy Megatron's groups and every other group but the world (the next case builds its
    own)."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    # megatron-core itself looks groups up in this registry (parallel_state's destroy).
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


def run_cases(cases: Iterable[dict], run: Callable[[dict], None]) -> None:
    """Run every case on every rank in step, say "case NAME done" from rank 0 after each (the
    launching test reads those lines), then leave the process group."""
    from megatron.core import parallel_state as ps

    for case in cases:
        run(case)
        dist.barrier()
        if dist.get_rank() == 0:
            print(f"case {case['name']} done", flush=True)
    ps.destroy_model_parallel()
    dist.destroy_process_group()
