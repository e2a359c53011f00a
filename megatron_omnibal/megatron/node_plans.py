"""Each epoch's balanced plan computed once per node and mapped read-only by its other ranks.

Why: the plan is the same on every rank (the balancer is deterministic), and at 12 million
samples one balance() call takes about half a minute and a GB or more at its peak; eight ranks
of a node computing it each pay that eight times over, in time on shared cores and in memory.
Here the node's local rank 0 balances the epoch and writes the plan's arrays as .npy files into
a folder whose name holds the stream's identity and the epoch; the other local ranks wait for
the folder to appear (it is renamed into place whole, so a rank never sees half a plan) and
np.load the arrays with mmap_mode='r', so the node holds one copy in its page cache.

A folder left by an earlier run of the same stream is used as it is (its name says it is the
same plan). The writer removes the folder of the epoch before last when it moves on to a new
epoch, and the folders it used when its process exits. Pure numpy: no torch, no Megatron.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from megatron_omnibal.balance.balancer import balance
from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.balance.plan_io import BalancePlan
from megatron_omnibal.data.lengths import LengthStats

ARRAYS = ("samples", "pack_ptr", "pack_step", "pack_rank", "pack_micro", "skipped", "pack_level")
META = "meta.json"
WAIT_S = 3600.0  # how long a rank waits for its node's writer (torchrun ends it sooner on error)
POLL_S = 0.02


def default_folder() -> Path:
    """/dev/shm where it exists (memory, local to the node), else the temporary folder."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def plan_name(identity: dict, epoch: int) -> str:
    """The folder name of one epoch's plan: the balance seed of the epoch and a digest of the
    stream's identity (lengths, budgets, balancer options, packer version)."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    return f"omnibal-epoch-plan-{digest}-seed{int(identity['seed']) + epoch}-epoch{epoch}"


def write_plan(plan: BalancePlan, folder: Path) -> None:
    """The plan's arrays as .npy files and its meta as JSON, renamed into `folder` whole."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name in ARRAYS:
            np.save(tmp / f"{name}.npy", np.ascontiguousarray(getattr(plan, name)))
        (tmp / META).write_text(json.dumps(plan.meta))
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / META).is_file():  # not another writer of the same plan first
            raise


def map_plan(folder: Path) -> BalancePlan:
    """A plan written by write_plan, its arrays mapped read-only."""
    arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in ARRAYS}
    return BalancePlan(**arrays, meta=json.loads((folder / META).read_text()))


class NodePlans:
    """`plans(epoch)`: the whole balanced plan of an epoch, balanced by the node's writer (local
    rank 0) and mapped by the others; the last plan is kept in the process.

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
        self._last: tuple[int, BalancePlan] | None = None
        self._written: list[Path] = []
        if self.writer:
            atexit.register(self._remove, self._written)

    def __call__(self, epoch: int) -> BalancePlan:
        if self._last is not None and self._last[0] == epoch:
            return self._last[1]
        folder = self.folder / plan_name(self._identity, epoch)
        if not self.writer:
            self._wait(folder)
        else:
            if not (folder / META).is_file():
                config = self._config.with_seed(self._config.seed + epoch)
                write_plan(balance(self._lengths_of(epoch), config), folder)
            self._written.append(folder)
            self._remove(self._written[:-2])  # the epoch before last: no rank reads it again
            del self._written[:-2]
        plan = map_plan(folder)
        self._last = (epoch, plan)
        return plan

    def _wait(self, folder: Path) -> None:
        waited = 0.0
        while not (folder / META).is_file():
            if waited >= self._wait_s:
                raise TimeoutError(
                    f"waited {waited:.0f} s for the node's epoch plan {folder} (written by local "
                    "rank 0)"
                )
            time.sleep(POLL_S)
            waited += POLL_S

    @staticmethod
    def _remove(folders: list[Path]) -> None:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
