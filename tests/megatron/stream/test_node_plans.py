"""Epoch plans balanced (and lengths read) once per node: local rank 0 writes, the other ranks
map the same arrays read-only; a rank that finds no plan waits, and says which file it waited
for."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from megatron_omnibal.balance.balancer import balance
from megatron_omnibal.balance.config import BalanceConfig
from megatron_omnibal.data.lengths import from_arrays
from megatron_omnibal.megatron.stream import node_plans
from megatron_omnibal.megatron.stream.data_identity import lengths_digest
from megatron_omnibal.megatron.stream.node_plans import NodePlans
from megatron_omnibal.megatron.stream.stream_steps import StreamSteps

RNG = np.random.default_rng(0)
LENGTHS = from_arrays(RNG.integers(1, 6, 300), RNG.integers(50, 400, 300))
CONFIG = BalanceConfig(dp_size=4, micro_batches=2, vit_budget=12, token_budget=900, seed=3)
IDENTITY = {"seed": 3, "lengths": "test"}
ARRAYS = node_plans.ARRAYS


def _same(a, b) -> None:
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.meta == b.meta


def test_the_writer_balances_once_and_readers_map_the_same_plan(tmp_path, monkeypatch) -> None:
    """Oracle: balance() of each epoch's seed in this process. A reader started before the
    writer waits for it; each epoch is balanced once on the node, the arrays readers get are
    read-only maps, and the writer's files are gone when it is done."""
    calls = []

    def counted(lengths, config):
        calls.append(config.seed)
        return balance(lengths, config)

    monkeypatch.setattr(node_plans, "balance", counted)
    writer = NodePlans(lambda e: LENGTHS, CONFIG, IDENTITY, local_rank=0, folder=tmp_path)
    readers = [NodePlans(lambda e: LENGTHS, CONFIG, IDENTITY, local_rank=r, folder=tmp_path,
                         wait_s=60) for r in (1, 2)]  # fmt: skip
    got = {}
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, [readers[r](e)
                                                                       for e in (0, 1)]))
               for r in (0, 1)]  # fmt: skip
    for t in threads:
        t.start()
    mine = [writer(e) for e in (0, 1)]
    for t in threads:
        t.join()
    assert calls == [3, 4]  # epoch e balances with seed + e, once
    for e in (0, 1):
        want = balance(LENGTHS, CONFIG.with_seed(3 + e))
        _same(mine[e], want)
        for r in (0, 1):
            _same(got[r][e], want)
            assert not got[r][e].samples.flags.writeable
    assert writer(1) is mine[1] and calls == [3, 4]  # kept mapped, not balanced again
    for plans in (writer, *readers):  # the per-step sums, summed once by the writer
        summed = StreamSteps(plans, lambda e: LENGTHS, steps_of_epoch=plans.steps)
        own = StreamSteps(lambda e: balance(LENGTHS, CONFIG.with_seed(3 + e)), lambda e: LENGTHS)
        for e in (0, 1):
            for field in node_plans.STEP_ARRAYS:
                np.testing.assert_array_equal(getattr(summed.epoch(e), field),
                                              getattr(own.epoch(e), field))
    assert calls == [3, 4]
    writer._remove(writer._used)
    assert not list(tmp_path.iterdir())


def test_a_reader_without_its_writer_stops_naming_the_file(tmp_path) -> None:
    reader = NodePlans(lambda e: LENGTHS, CONFIG, IDENTITY, local_rank=1, folder=tmp_path,
                       wait_s=0.1)  # fmt: skip
    with pytest.raises(TimeoutError, match=r"omnibal-epoch-plan-.*-seed5-epoch2.*local rank 0"):
        reader(2)


def test_lengths_are_made_once_and_mapped_by_the_other_ranks(tmp_path) -> None:
    """Oracle: the lengths themselves. The writer makes them once, a reader (started first)
    maps an equal read-only copy; another key is another file."""
    made = []

    def make():
        made.append(1)
        return LENGTHS

    got = {}
    reader = threading.Thread(target=lambda: got.setdefault(
        "r", node_plans.node_lengths(make, {"k": 1}, local_rank=1, folder=tmp_path)))
    reader.start()
    mine = node_plans.node_lengths(make, {"k": 1}, local_rank=0, folder=tmp_path)
    reader.join()
    assert made == [1]
    for lengths, digest in (mine, got["r"]):
        assert digest == lengths_digest(LENGTHS)  # taken by the writer, read by the others
        for field in ("vit", "tokens", "image_flags", "dataset"):
            np.testing.assert_array_equal(getattr(lengths, field), getattr(LENGTHS, field))
            assert not getattr(lengths, field).flags.writeable
        assert lengths.names == LENGTHS.names
    node_plans.node_lengths(make, {"k": 2}, local_rank=0, folder=tmp_path)
    assert made == [1, 1] and len(list(tmp_path.glob("omnibal-lengths-*"))) == 2


def test_jobs_of_a_static_rendezvous_get_their_own_names(monkeypatch) -> None:
    """torchrun's run id is "none" in every static-rendezvous job: the agent's pid tells two such
    jobs on one node apart (a preflight, then the training of the same plan)."""
    import os

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("GROUP_RANK", "1")
    assert node_plans.job_id() == f"none-node1-pid{os.getppid()}"
    assert node_plans.OWNER.match(node_plans.plan_name(IDENTITY, 0, node_plans.job_id()))


def test_a_killed_jobs_folders_are_removed_and_a_live_ones_kept(tmp_path) -> None:
    """The folders of a job killed before its exit handlers ran (its owner's pid is gone) are
    removed when the next writer starts; a running job's, and files of other names, stay."""
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    names = {
        f"omnibal-epoch-plan-none-node0-pid{dead}-abc-seed1-epoch0": False,
        f"omnibal-lengths-run-node0-pid{dead}-abc": False,
        f"omnibal-record-index-run-node0-pid{dead}-abc": False,
        f".omnibal-epoch-plan-pid{dead}-abc-seed1-epoch0.tmp1": False,
        f"omnibal-epoch-plan-none-node0-pid{os.getpid()}-abc-seed1-epoch0": True,
        "omnibal-notes": True,
    }
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text("{}")
    NodePlans(lambda e: LENGTHS, CONFIG, IDENTITY, local_rank=0, folder=tmp_path)
    assert {n: (tmp_path / n).exists() for n in names} == names
    later = tmp_path / f"omnibal-lengths-run-node0-pid{dead}-def"
    later.mkdir()  # the folder is swept once per process, by its first writer
    node_plans.node_lengths(lambda: LENGTHS, {"k": 3}, local_rank=0, folder=tmp_path)
    assert later.exists()


def test_a_folder_left_under_the_same_name_is_replaced(tmp_path) -> None:
    """An epoch plan already under the writer's name (an earlier process of the job wrote it) is
    replaced by the new one, not a crash in the rename."""
    writer = NodePlans(lambda e: LENGTHS, CONFIG, IDENTITY, local_rank=0, folder=tmp_path)
    folder = tmp_path / node_plans.plan_name(IDENTITY, 0, node_plans.job_id())
    folder.mkdir()
    (folder / "stale.npy").write_bytes(b"x")
    _same(writer(0), balance(LENGTHS, CONFIG))
    assert not (folder / "stale.npy").exists()


def test_only_a_process_among_several_on_its_node_shares(monkeypatch) -> None:
    """Under torchrun with several local ranks, a rank's local rank decides who writes; a lone
    process (no torchrun, or one rank per node) makes its own."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert node_plans.shared_local_rank() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert node_plans.shared_local_rank() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert node_plans.shared_local_rank() == 2
