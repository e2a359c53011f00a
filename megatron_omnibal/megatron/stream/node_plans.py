"""Each epoch's balanced plan (and the run's lengths) made once per node and mapped read-only by
its other ranks.

Why: the plan is the same on every rank (the balancer is deterministic), and at 12 million
samples one balance() call takes about half a minute and a GB or more at its peak; eight ranks
of a node computing it each pay that eight times over, in time on shared cores and in memory.
Here the node's local rank 0 balances the epoch and writes the plan's arrays as .npy files into
a folder whose name holds the job, the stream's identity and the epoch; the other local ranks
wait for the folder to appear (it is renamed into place whole, so a rank never sees half a
plan) and np.load the arrays with mmap_mode='r', so the node holds one copy in its page cache.
The writer also sums the plan per step and rank (stream_steps.epoch_steps: what the training log
and the consumed-sample count read) and writes the sums beside it, so no rank walks the epoch's
samples again.

The writer removes the folders it wrote when its process exits, not before: a rank that resumes
walks the epochs from the stream's origin to count their steps and may ask for an
early epoch after the writer moved on. A job killed before its exit handlers ran (torchrun ends
the other ranks with SIGTERM when one fails) leaves its folders behind: every name carries the pid
of the process that owns the job on this node, and the next writer removes the folders of pids
no longer alive. The folder (in /dev/shm: memory) so holds one plan per
epoch the run reached, about 20 bytes per sample each. The lengths (28 bytes per sample, read,
checked and converted for the model) are shared the same way, with their digest for the stream's
identity (`node_lengths`), and so is a real data source's record index (`node_arrays`: its
arrays and a JSONL file's line offsets, about 14 + 8 bytes per sample; a scan of the
annotation files is a CPU second per million lines). Pure numpy: no torch, no Megatron.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from megatron_omnibal.balance.balancer import balance
from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.balance.plan_io import BalancePlan
from megatron_omnibal.data.lengths import LengthStats
from megatron_omnibal.megatron.stream.data_identity import lengths_digest
from megatron_omnibal.megatron.stream.stream_steps import EpochSteps, epoch_steps

ARRAYS = ("samples", "pack_ptr", "pack_step", "pack_rank", "pack_micro", "skipped", "pack_level")
STEP_ARRAYS = ("samples", "tiles", "tokens", "sumsq")  # EpochSteps' fields, as "steps_<name>"
LENGTH_FIELDS = ("vit", "tokens", "image_flags", "dataset")
META = "meta.json"
WAIT_S = 3600.0  # how long a rank waits for its node's writer (torchrun ends it sooner on error)
POLL_S = (0.02, 0.5)  # a waiting rank's first and longest pause between looks
KEPT = 2  # mapped plans kept per process


def default_folder() -> Path:
    """/dev/shm where it exists (memory, local to the node), else the temporary folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


KINDS = ("epoch-plan", "lengths", "record-index")  # the folders this module writes
OWNER = re.compile(rf"^\.?omnibal-(?:{'|'.join(KINDS)})-(?:.+-)?pid(\d+)-")


def shared_local_rank() -> int | None:
    """This process's local rank when torchrun started several on the node (one of them makes
    what all of them map), else None: a lone process makes its own."""
    if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) < 2:
        return None
    return int(os.environ.get("LOCAL_RANK", "0"))


def job_id() -> str:
    """The job's id on this node: torchrun's run id and node rank (several "nodes" may share one
    host) and the pid of the torchrun agent that started this node's ranks (the run id of a static
    rendezvous is "none" in every job), else this process's pid (a run without torchrun)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run:
        return f"pid{os.getpid()}"
    return f"{run}-node{os.environ.get('GROUP_RANK', '0')}-pid{os.getppid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process
    return True


_SWEPT: set[Path] = set()  # folders this process already swept (a writer writes several kinds)


def remove_stale(folder: Path) -> None:
    """Remove the folders of this module's kinds in `folder` whose owning process is gone (a job
    killed before its exit handlers ran); once per folder and process."""
    if folder in _SWEPT:
        return
    _SWEPT.add(folder)
    for entry in folder.iterdir():
        owner = OWNER.match(entry.name)
        if owner and not _alive(int(owner.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def plan_name(identity: dict, epoch: int, job: str) -> str:
    """The folder name of one epoch's plan: the job, a digest of the stream's identity
    (lengths, budgets, balancer options, packer version), the epoch and its balance seed."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    seed = int(identity["seed"]) + epoch
    return f"omnibal-epoch-plan-{job}-{digest}-seed{seed}-epoch{epoch}"


def write_arrays(arrays: dict[str, np.ndarray], meta: dict, folder: Path) -> None:
    """Arrays as .npy files and `meta` as JSON, renamed into `folder` whole. A folder already
    there (an earlier process of this job wrote the same deterministic arrays) is replaced: a rank
    that mapped its files keeps them until it unmaps them."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(array))
        (tmp / META).write_text(json.dumps({"arrays": list(arrays), "meta": meta}))
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def map_arrays(folder: Path) -> tuple[dict[str, np.ndarray], dict]:
    """The arrays and meta written by write_arrays, the arrays mapped read-only."""
    doc = json.loads((folder / META).read_text())
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in doc["arrays"]}
    return arrays, doc["meta"]


def wait_for(folder: Path, wait_s: float = WAIT_S) -> None:
    """Return once `folder` was written (its meta is the last part renamed into place). The
    pause between looks doubles up to half a second: seven ranks looking every 20 ms through a
    half-minute balance take a core's worth of seconds from the writer they wait for."""
    waited, pause = 0.0, POLL_S[0]
    while not (folder / META).is_file():
        if waited >= wait_s:
            raise TimeoutError(
                f"waited {waited:.0f} s for {folder}, which the node's local rank 0 writes"
            )
        time.sleep(pause)
        waited += pause
        pause = min(2 * pause, POLL_S[1])


def write_plan(plan: BalancePlan, steps: EpochSteps, folder: Path) -> None:
    """The plan's arrays and its per-step sums, renamed into `folder` whole."""
    arrays = {name: getattr(plan, name) for name in ARRAYS}
    arrays.update({f"steps_{name}": getattr(steps, name) for name in STEP_ARRAYS})
    write_arrays(arrays, plan.meta, folder)


def map_plan(folder: Path) -> tuple[BalancePlan, EpochSteps]:
    """A plan and its per-step sums written by write_plan, their arrays mapped read-only."""
    arrays, meta = map_arrays(folder)
    plan = BalancePlan(**{name: arrays[name] for name in ARRAYS}, meta=meta)
    return plan, EpochSteps(**{name: arrays[f"steps_{name}"] for name in STEP_ARRAYS})


class NodeLengths(NamedTuple):
    """The run's lengths and their digest (data_identity.lengths_digest: the stream's identity)."""

    lengths: LengthStats
    sha256: str


def node_arrays(
    make: Callable[[], tuple[dict[str, np.ndarray], dict]], kind: str, key: dict, *,
    local_rank: int, folder: Path | None = None,
) -> tuple[dict[str, np.ndarray], dict]:
    """Arrays and their meta made once per node: `make()` on local rank 0, written next to the
    epoch plans under a name from `kind` (one of KINDS), the job and `key`; every local rank
    maps them read-only (the others rely on the writer's checks: when it fails, torchrun stops
    them). Removed when local rank 0 exits."""
    if kind not in KINDS:
        raise ValueError(f"node arrays of kind {kind!r}: one of {', '.join(KINDS)}")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = (folder or default_folder()) / f"omnibal-{kind}-{job_id()}-{digest}"
    if local_rank == 0:
        remove_stale(path.parent)
        arrays, meta = make()
        write_arrays(arrays, meta, path)
        del arrays  # the node's one copy is the mapped one, also here
        atexit.register(shutil.rmtree, path, True)
    else:
        wait_for(path)
    return map_arrays(path)


def node_lengths(
    make: Callable[[], LengthStats], key: dict, *, local_rank: int, folder: Path | None = None
) -> NodeLengths:
    """The run's lengths and their digest, made once per node (node_arrays): `make()` (read,
    checked and converted for the model) and the digest on local rank 0."""

    def made() -> tuple[dict[str, np.ndarray], dict]:
        lengths = make()
        return ({f: getattr(lengths, f) for f in LENGTH_FIELDS},
                {"names": list(lengths.names), "sha256": lengths_digest(lengths)})

    arrays, meta = node_arrays(made, "lengths", key, local_rank=local_rank, folder=folder)
    return NodeLengths(LengthStats(**arrays, names=tuple(meta["names"])), meta["sha256"])


class NodePlans:
    """`plans(epoch)`: the whole balanced plan of an epoch, balanced by the node's writer (local
    rank 0) and mapped by the others; `plans.steps(epoch)`: its per-step sums, made and mapped
    alike. The last two epochs stay mapped in the process.

    `lengths_of(epoch)` and `config` are the sampler's (epoch e balances with seed + e);
    `identity` names the stream (data_identity.StreamIdentity.to_dict()).
    """

    def __init__(
        self,
        lengths_of: Callable[[int], LengthStats],
        config: BalanceConfig,
        identity: dict,
        *,
        local_rank: int,
        folder: Path | None = None,
        wait_s: float = WAIT_S,
    ) -> None:
        self._lengths_of = lengths_of
        self._config = config
        self._identity = identity
        self.writer = local_rank == 0
        self.folder = folder or default_folder()
        self._wait_s = wait_s
        self._job = job_id()
        self._plans: dict[int, tuple[BalancePlan, EpochSteps]] = {}
        self._used: list[Path] = []
        if self.writer:
            remove_stale(self.folder)
            atexit.register(self._remove, self._used)

    def __call__(self, epoch: int) -> BalancePlan:
        return self._mapped(epoch)[0]

    def steps(self, epoch: int) -> EpochSteps:
        """The per (step, rank) sums of the epoch's plan (stream_steps.epoch_steps)."""
        return self._mapped(epoch)[1]

    def _mapped(self, epoch: int) -> tuple[BalancePlan, EpochSteps]:
        if epoch in self._plans:
            return self._plans[epoch]
        folder = self.folder / plan_name(self._identity, epoch, self._job)
        if not self.writer:
            wait_for(folder, self._wait_s)
        elif folder not in self._used:
            lengths = self._lengths_of(epoch)
            plan = balance(lengths, self._config.with_seed(self._config.seed + epoch))
            write_plan(plan, epoch_steps(plan, lengths), folder)
            del plan  # the node's one copy is the mapped one, also here
            self._used.append(folder)
        self._plans[epoch] = map_plan(folder)
        while len(self._plans) > KEPT:  # the stream and the sampler stand in the last two
            del self._plans[min(self._plans)]
        return self._plans[epoch]

    @staticmethod
    def _remove(folders: list[Path]) -> None:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
