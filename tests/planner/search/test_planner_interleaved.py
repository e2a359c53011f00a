"""Interleaved (virtual-stage) partition search against brute force on small profiles.

The oracles: every contiguous split into pp x vpp virtual stages, every recompute count per
chunk, each rank's memory replayed along Megatron's interleaved order (live micro-batches per
chunk after every operation), each split timed by the event-driven simulator.
"""

import itertools

import numpy as np
import pytest

from megatron_omnibal.planner.cost_model.memory import (
    inflight_states,
    stage_memory_mib,
    stage_time_ms,
)
from megatron_omnibal.planner.search.interleaved import InterleavedProblem, search_interleaved
from megatron_omnibal.planner.search.partition import NoFeasiblePartition, Problem
from megatron_omnibal.planner.simulator.simulate import order_interleaved, simulate
from tests.planner.search.test_planner_partition import harsh_costs, random_costs


def replayed_peak(costs, segments, counts, rank, pp, vpp, m):
    """Rank memory by replaying its order: static + the most stored at any moment."""
    static = [
        stage_memory_mib(costs, lo, hi, k, 0) for (lo, hi), k in zip(segments, counts, strict=True)
    ]
    stored = [
        stage_memory_mib(costs, lo, hi, k, 1) - s
        for (lo, hi), k, s in zip(segments, counts, static, strict=True)
    ]
    live, peak = [0] * vpp, 0.0
    for kind, chunk, _ in order_interleaved(rank, pp, vpp, m):
        live[chunk] += 1 if kind == "F" else -1
        peak = max(peak, sum(n * s for n, s in zip(live, stored, strict=True)))
    return sum(static) + peak


def options(costs, lo, hi):
    groups = sorted({int(g) for g in costs.group[lo:hi] if g >= 0})
    sizes = [int(np.sum(costs.group[lo:hi] == g)) for g in groups]
    for combo in itertools.product(*[range(k + 1) for k in sizes]):
        yield dict(zip(groups, combo, strict=True))


def brute(problem, pp, vpp):
    """(best step with each rank's least-total-recompute choice, best over every choice)."""
    c, u, m, nv = problem.costs, problem.units, problem.m, pp * vpp
    best_rule, best_any = np.inf, np.inf
    for cuts in itertools.combinations(range(1, u), nv - 1):
        bounds = (0, *cuts, u)
        per_rank = []  # per rank: feasible (total rec ms, layers, counts per chunk)
        for r in range(pp):
            segs = [(bounds[k * pp + r], bounds[k * pp + r + 1]) for k in range(vpp)]
            fits = []
            for counts in itertools.product(*[list(options(c, lo, hi)) for lo, hi in segs]):
                if replayed_peak(c, segs, counts, r, pp, vpp, m) <= problem.budget + 1e-6:
                    rec = sum(
                        sum(stage_time_ms(c, lo, hi, k))
                        for (lo, hi), k in zip(segs, counts, strict=True)
                    )
                    fits.append((rec, sum(sum(k.values()) for k in counts), counts))
            if not fits:
                break
            per_rank.append(fits)
        if len(per_rank) < pp:
            continue
        p2p = problem.p2p[list(cuts)][:, None]

        def step(choice, bounds=bounds, p2p=p2p):
            fwd, bwd = np.zeros(nv), np.zeros(nv)
            for r, counts in enumerate(choice):
                for k, cnt in enumerate(counts):
                    v = k * pp + r
                    fwd[v], bwd[v] = stage_time_ms(c, bounds[v], bounds[v + 1], cnt)
            f, b = np.repeat(fwd[:, None], m, 1), np.repeat(bwd[:, None], m, 1)
            return simulate(f, b, pp, vpp, p2p, keep_ops=False).makespan_ms

        rule = [min(f, key=lambda x: (x[0], x[1]))[2] for f in per_rank]
        best_rule = min(best_rule, step(rule))
        if np.prod([len(f) for f in per_rank]) <= 400:
            for choice in itertools.product(*[[x[2] for x in f] for f in per_rank]):
                best_any = min(best_any, step(choice))
    return best_rule, best_any


def test_inflight_states_match_a_replay_of_megatrons_order():
    for pp, vpp, m in ((2, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 6), (4, 2, 4)):
        for r in range(pp):
            states = inflight_states(r, pp, vpp, m)
            live, seen = [0] * vpp, []
            for kind, chunk, _ in order_interleaved(r, pp, vpp, m):
                live[chunk] += 1 if kind == "F" else -1
                seen.append(tuple(live))
            # every moment is covered by a kept state, and every kept state occurs
            assert all(
                any(all(a >= b for a, b in zip(s, x, strict=True)) for s in states) for x in seen
            )
            assert set(states) <= set(seen)
            assert max(sum(s) for s in states) == min(
                (pp - r - 1) * 2 + (vpp - 1) * pp + 1, m * vpp
            )


def case(seed):
    rng = np.random.default_rng(seed)
    pp, vpp = (2, 2) if seed % 3 else (3, 2)
    units = int(rng.integers(pp * vpp + 1, pp * vpp + 3))
    costs = (harsh_costs if seed % 4 == 0 else random_costs)(
        rng, units, **({} if seed % 4 == 0 else {"uniform": seed % 2 == 1})
    )
    m = pp * int(rng.integers(1, 3))
    total = float(costs.static_mib.sum() + costs.activation_mib.sum() * 2 * pp)
    budget = total / pp * rng.uniform(0.3, 1.0)
    p2p = rng.uniform(0, 0.3, units + 1)
    return Problem(costs, m, budget, p2p), pp, vpp


@pytest.mark.parametrize("seed", range(24))
def test_search_matches_brute_force(seed):
    problem, pp, vpp = case(seed)
    rule, any_choice = brute(problem, pp, vpp)
    if not np.isfinite(rule):
        with pytest.raises(NoFeasiblePartition):
            search_interleaved(problem, pp, vpp)
        return
    part = search_interleaved(problem, pp, vpp, tolerance=0.0)
    assert part.step_ms == pytest.approx(rule, rel=1e-9)
    assert part.lower_bound_ms <= rule * (1 + 1e-9)
    # the rank-joint recompute rule against every recompute choice: within 3% here
    assert any_choice <= part.step_ms * (1 + 1e-9)
    assert part.step_ms <= any_choice * 1.03
    # what the partition reports is what the simulator and the replayed memory say
    m, nv = problem.m, pp * vpp
    f = np.repeat(part.forward_ms[:, None], m, 1)
    b = np.repeat(part.backward_ms[:, None], m, 1)
    p2p = problem.p2p[list(part.bounds[1:-1])][:, None]
    assert simulate(f, b, pp, vpp, p2p).makespan_ms == pytest.approx(part.step_ms)
    for r in range(pp):
        segs = [part.stages[k * pp + r] for k in range(vpp)]
        counts = [part.recompute[k * pp + r] for k in range(vpp)]
        peak = replayed_peak(problem.costs, segs, counts, r, pp, vpp, m)
        assert peak <= problem.budget + 1e-6
        assert part.memory_mib[r] == pytest.approx(peak)
    assert len(part.stages) == nv and part.vpp == vpp


def test_default_tolerance_certifies_and_screening_is_feasible():
    problem, pp, vpp = case(5)
    rule, _ = brute(problem, pp, vpp)
    certified = search_interleaved(problem, pp, vpp)
    assert certified.step_ms <= rule * 1.001
    assert certified.step_ms <= certified.lower_bound_ms * 1.001
    quick = search_interleaved(problem, pp, vpp, tolerance=None)
    assert quick.step_ms >= rule * (1 - 1e-9)


def test_rank_choice_is_the_least_total_recompute_that_fits():
    problem, pp, vpp = case(7)
    ip = InterleavedProblem(problem, pp, vpp)
    c = problem.costs
    for cuts in itertools.combinations(range(1, problem.units), pp * vpp - 1):
        bounds = (0, *cuts, problem.units)
        for r in range(pp):
            segs = ip.rank_segments(bounds, r)
            got = ip.choose(r, segs)
            fits = [
                sum(
                    sum(stage_time_ms(c, lo, hi, k))
                    for (lo, hi), k in zip(segs, counts, strict=True)
                )
                for counts in itertools.product(*[list(options(c, lo, hi)) for lo, hi in segs])
                if replayed_peak(c, segs, counts, r, pp, vpp, problem.m) <= problem.budget + 1e-6
            ]
            if not fits:
                assert got is None
            else:
                assert sum(got.forward_ms) + sum(got.backward_ms) == pytest.approx(min(fits))


def test_refuses_what_megatron_refuses():
    problem, _, _ = case(1)
    with pytest.raises(ValueError, match="divisible by pp"):
        search_interleaved(Problem(problem.costs, 3, problem.budget), 2, 2)
    with pytest.raises(ValueError, match="virtual stages"):
        search_interleaved(problem, 2, problem.units)
