"""Pipeline simulator against hand-computed schedules and an independent longest-path oracle."""

import numpy as np
import pytest

from megatron_omnibal.planner.simulator.simulate import (
    order_1f1b,
    order_interleaved,
    simulate,
    simulate_step,
)


def test_1f1b_two_stages_by_hand():
    # f = 1, b = 2 on both stages, 2 micro-batches; worked out on paper:
    # r0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9];  r1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]
    t = simulate(np.ones((2, 2)), np.full((2, 2), 2.0), 2)
    got = {(o.rank, o.kind, o.micro_batch): (o.start, o.end) for o in t.ops}
    assert got == {
        (0, "F", 0): (0, 1),
        (0, "F", 1): (1, 2),
        (0, "B", 0): (4, 6),
        (0, "B", 1): (7, 9),
        (1, "F", 0): (1, 2),
        (1, "B", 0): (2, 4),
        (1, "F", 1): (4, 5),
        (1, "B", 1): (5, 7),
    }
    assert t.makespan_ms == 9
    assert t.busy_ms.tolist() == [6, 6]
    assert t.bubble_fraction == pytest.approx(1 - 12 / 18)


def test_1f1b_with_p2p_by_hand():
    # as above with 0.5 ms per transfer: r1 F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5];
    # r0 B0 waits for the gradient: [5,7], B1 [8,10]
    t = simulate(np.ones((2, 2)), np.full((2, 2), 2.0), 2, p2p_ms=0.5)
    got = {(o.rank, o.kind, o.micro_batch): (o.start, o.end) for o in t.ops}
    assert got[(1, "F", 0)] == (1.5, 2.5) and got[(0, "B", 0)] == (5, 7)
    assert t.makespan_ms == 10


def test_interleaved_two_ranks_two_chunks_by_hand():
    # pp=2, vpp=2, m=2, all ops 1 ms; rank 0 warms up all 4 forwards, rank 1 two; on paper the
    # last backward (virtual stage 0, micro-batch 1) ends at 10
    t = simulate(np.ones((4, 2)), np.ones((4, 2)), 2, 2)
    got = {(o.rank, o.chunk, o.kind, o.micro_batch): (o.start, o.end) for o in t.ops}
    assert got[(1, 1, "B", 0)] == (4, 5)
    assert got[(1, 1, "F", 1)] == (5, 6)
    assert got[(0, 0, "B", 1)] == (9, 10)
    assert t.makespan_ms == 10 and t.busy_ms.tolist() == [8, 8]


def test_orders_cover_every_op_once():
    for pp, vpp, m in ((4, 1, 3), (4, 1, 8), (2, 3, 4), (4, 2, 8)):
        for r in range(pp):
            order = order_1f1b(r, pp, m) if vpp == 1 else order_interleaved(r, pp, vpp, m)
            want = {(k, c, j) for k in "FB" for c in range(vpp) for j in range(m)}
            assert sorted(order) == sorted(want)


def longest_path(fwd, bwd, pp, vpp, p2p):
    """Oracle: earliest times by relaxing the DAG (same orders) until nothing changes."""
    nv, m = fwd.shape
    orders = [
        order_1f1b(r, pp, m) if vpp == 1 else order_interleaved(r, pp, vpp, m) for r in range(pp)
    ]
    end = {}
    changed = True
    while changed:
        changed = False
        for r in range(pp):
            prev = 0.0
            for kind, c, j in orders[r]:
                v = c * pp + r
                deps = [prev]
                if kind == "F" and v > 0:
                    deps.append(end.get(("F", v - 1, j), np.nan) + p2p)
                if kind == "B":
                    deps.append(end.get(("F", v, j), np.nan))
                    if v < nv - 1:
                        deps.append(end.get(("B", v + 1, j), np.nan) + p2p)
                if any(np.isnan(deps)):
                    break
                e = max(deps) + (fwd if kind == "F" else bwd)[v, j]
                if end.get((kind, v, j)) != e:
                    end[(kind, v, j)] = e
                    changed = True
                prev = e
    return max(end.values())


@pytest.mark.parametrize("seed", range(12))
def test_random_schedules_match_longest_path(seed):
    rng = np.random.default_rng(seed)
    pp = int(rng.integers(1, 5))
    vpp = int(rng.integers(1, 3)) if pp > 1 else 1
    m = pp * int(rng.integers(1, 4)) if vpp > 1 else int(rng.integers(1, 9))
    fwd = rng.uniform(0.5, 2, (pp * vpp, m))  # per-micro-batch times: data variability
    bwd = fwd * rng.uniform(1.5, 3, (pp * vpp, m))
    p2p = float(rng.uniform(0, 0.3)) if pp > 1 else 0.0
    t = simulate(fwd, bwd, pp, vpp, p2p)
    assert t.makespan_ms == pytest.approx(longest_path(fwd, bwd, pp, vpp, p2p))
    assert t.busy_ms.sum() == pytest.approx(fwd.sum() + bwd.sum())


def test_slowest_replica_gates_the_step():
    fast = (np.ones((2, 2)), np.full((2, 2), 2.0))
    slow = (np.full((2, 2), 2.0), np.full((2, 2), 4.0))
    res = simulate_step([fast, slow], 2, sync_ms=3.0)
    assert res.pipeline_ms == 18 and res.step_ms == 21
    assert res.replica_ms.tolist() == [9, 18]


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match=r"expected \(4, m\)"):
        simulate(np.ones((3, 2)), np.ones((3, 2)), 2, 2)
    with pytest.raises(ValueError, match="divisible by pp"):
        simulate(np.ones((4, 3)), np.ones((4, 3)), 2, 2)
