"""N local gloo ranks of one program, forked from one interpreter that imported torch and
megatron-core once: the launcher of the CPU tools (`omnibal convert`'s torch_dist writer,
`omnibal compare-hf`'s stages).

Why not torchrun: torchrun starts each rank as a fresh interpreter, and on a CPU the import of
torch and megatron-core (about 5 CPU seconds and a few hundred MB per process) is most of what
such a tool's rank does. Here the launcher imports them once (`enable_cpu_megatron()`), then
forks the ranks, which share those pages copy-on-write. Each rank sees the environment torchrun
would give it (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID, ...), so a
program runs unchanged under either. As under torchrun, the first rank to fail stops the others
and its exit code is the launcher's. Only for CPU ranks: a forked process cannot use CUDA that
its parent initialised, so `run` hides the GPUs.

    python -m megatron_omnibal.megatron.runtime.local_ranks --nproc-per-node N \\
        (-m MODULE | SCRIPT) [ARGS...]

It also takes the command line of a single-node torchrun (`--standalone`, `--nnodes 1`,
`--node-rank 0`, `--rdzv-*`), so it can stand in for torchrun as the launch scripts' $TORCHRUN
(scripts/launch_single_node.sh --cpu): the ranks then meet at a free local port, whatever
rendezvous was named. Several nodes need torchrun: `--nnodes` above 1 is refused.
"""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence

from megatron_omnibal.megatron.runtime.ports import free_port

GRACE_S = 10.0  # how long the other ranks get to stop after one failed, before SIGKILL


def command(nproc: int, program: Sequence[str]) -> list[str]:
    """The command line that runs `program` (`["-m", module, *args]` or `[script, *args]`) on
    `nproc` local ranks with this interpreter."""
    return [sys.executable, "-m", __name__, f"--nproc-per-node={nproc}", *program]


def run(nproc: int, program: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """`program` on `nproc` CPU ranks launched in a process of their own, GPUs hidden and one
    thread each, its output captured."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run(command(nproc, program), env=env, capture_output=True, text=True)


def rank_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What torchrun sets for local rank `rank` of a single-node job."""
    env = {"RANK": rank, "LOCAL_RANK": rank, "GROUP_RANK": 0, "ROLE_RANK": rank,
           "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "GROUP_WORLD_SIZE": 1,
           "ROLE_WORLD_SIZE": nproc, "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": port, "TORCHELASTIC_RUN_ID": run_id,
           "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0}  # fmt: skip
    return {k: str(v) for k, v in env.items()}


def _run_rank(env: dict[str, str], module: str | None, script: str | None,
              args: list[str]) -> None:
    """The child: the program as `__main__` with this rank's environment; never returns."""
    os.environ.update(env)
    code = 0
    try:
        if module:
            sys.argv = [module, *args]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` sets it
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:  # sys.exit("message"): printed, status 1, as the interpreter does
            sys.stderr.write(f"{e.code}\n")
            code = 1
    except BaseException:  # noqa: BLE001 - a rank reports any failure as torchrun's would
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # the handlers a normal interpreter exit would run
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


def _stop(pids: set[int]) -> None:
    """SIGTERM the ranks still running, SIGKILL those left after GRACE_S; reap them all."""
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            pids.discard(pid)
        else:
            time.sleep(0.05)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def launch(nproc: int, module: str | None, script: str | None, args: list[str]) -> int:
    """Fork `nproc` ranks of the program and wait: 0 if all succeed, else the first failure's
    exit code (a rank killed by a signal: 128 + the signal, as a shell reports it)."""
    from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron
    from megatron_omnibal.megatron.runtime.notes import quiet_fallback_warnings

    # megatron-core's per-module fallback warnings are printed at its import, so here, once
    # for all ranks; a program that wants them said says it once (pretrain_vlm's note)
    quiet_fallback_warnings()
    enable_cpu_megatron()  # torch and megatron-core, imported once for every rank
    port, run_id = free_port(), f"local{os.getpid()}"
    sys.stdout.flush()
    sys.stderr.flush()
    pids: set[int] = set()
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _run_rank(rank_env(rank, nproc, port, run_id), module, script, args)
        pids.add(pid)
    forward = {sig: signal.signal(sig, lambda s, _f: [os.kill(p, s) for p in pids])
               for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while pids:
            pid, status = os.wait()
            pids.discard(pid)
            code = os.waitstatus_to_exitcode(status)
            if code:
                _stop(pids)
                return code if code > 0 else 128 - code
        return 0
    finally:
        for sig, handler in forward.items():
            signal.signal(sig, handler)


USAGE = ("usage: python -m megatron_omnibal.megatron.runtime.local_ranks [--standalone] "
         "[--nnodes 1] --nproc-per-node N (-m MODULE | SCRIPT) [ARGS...]")
# torchrun's options of one node that change nothing here (the ranks meet at a free local port)
IGNORED = {"--standalone": 0, "--rdzv-backend": 1, "--rdzv-endpoint": 1, "--rdzv-id": 1}
ONE_NODE = {"--nnodes": ("1", "1:1"), "--node-rank": ("0",)}


def parse(argv: Sequence[str]) -> tuple[int, str | None, str | None, list[str]]:
    """(nproc, module, script, args) of the command line; ValueError with the usage if bad.
    Options come first, in torchrun's spellings (`--nproc_per_node=2` too); everything after
    the module or script is the program's own (as with torchrun)."""
    argv, nproc = list(argv), None
    while argv and argv[0].startswith("--"):
        name, has_value, value = argv.pop(0).partition("=")
        name = name.replace("_", "-")
        if name not in ("--nproc-per-node", *IGNORED, *ONE_NODE):
            raise ValueError(f"{name}: not an option of one node's torchrun that local_ranks "
                             f"takes\n{USAGE}")  # fmt: skip
        if not has_value and IGNORED.get(name, 1):
            if not argv:
                raise ValueError(f"{name} needs a value\n{USAGE}")
            value = argv.pop(0)
        if name in ONE_NODE and value not in ONE_NODE[name]:
            raise ValueError(f"{name} {value}: local_ranks runs one node (use torchrun for "
                             "several)")  # fmt: skip
        if name == "--nproc-per-node":
            nproc = _count(value)
    if nproc is None or not argv or argv[0] == "-m" and len(argv) < 2:
        raise ValueError(USAGE)
    if argv[0] == "-m":
        return nproc, argv[1], None, argv[2:]
    return nproc, None, argv[0], argv[1:]


def _count(value: str) -> int:
    try:
        nproc = int(value)
    except ValueError:
        raise ValueError(f"--nproc-per-node: not a number: {value!r}") from None
    if nproc < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc}")
    return nproc


def main(argv: Sequence[str] | None = None) -> int:
    try:
        nproc, module, script, args = parse(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        sys.stderr.write(f"local_ranks: {e}\n")
        return 2
    return launch(nproc, module, script, args)


if __name__ == "__main__":
    sys.exit(main())
