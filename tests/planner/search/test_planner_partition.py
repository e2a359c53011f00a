"""Partition search against brute force over every contiguous partition and recompute choice."""

import dataclasses
import itertools

import numpy as np
import pytest

from megatron_omnibal.planner.cost_model.costs import LayerCosts
from megatron_omnibal.planner.cost_model.memory import (
    inflight_1f1b,
    stage_memory_mib,
    stage_time_ms,
)
from megatron_omnibal.planner.search.exact import (
    bottleneck_signatures,
    certify,
    fill_drain_signatures,
    longest_paths,
    pipeline_graph,
)
from megatron_omnibal.planner.search.partition import (
    NoFeasiblePartition,
    Problem,
    bmp,
    forward_table,
    megatron_default,
    objective_candidates,
    search,
)
from megatron_omnibal.planner.search.recompute import cheapest_recompute
from megatron_omnibal.planner.simulator.simulate import simulate


def random_costs(rng, units, groups=(0, 1), uniform=False):
    """Random two-tower profile: a run of group-0 units, one projector (-1), then group-1."""
    n0 = int(rng.integers(1, units - 1))
    group = np.array([0] * n0 + [-1] + [1] * (units - n0 - 1))
    if uniform:  # identical layers per tower, like the analytic model (closed-form path)
        fwd = np.where(group == 0, rng.uniform(1, 3), rng.uniform(1, 3))
        act = np.where(group == 0, rng.uniform(50, 300), rng.uniform(50, 300))
    else:
        fwd = rng.uniform(0.5, 3.0, units)
        act = rng.uniform(50, 300, units)
    return LayerCosts(
        tuple(f"u{i}" for i in range(units)),
        fwd,
        fwd * rng.uniform(1.5, 2.5, units),
        np.where(group >= 0, fwd, 0.0),
        act,
        np.where(group >= 0, act * 0.1, act),
        rng.uniform(1, 5, units),
        rng.uniform(100, 400, units),
        group,
    )


def harsh_costs(rng, units):
    """Random profile whose backward/forward ratio varies 0.2x..5x from layer to layer."""
    n0 = int(rng.integers(1, units - 1))
    group = np.array([0] * n0 + [-1] + [1] * (units - n0 - 1))
    fwd = rng.uniform(0.2, 3.0, units)
    act = rng.uniform(50, 300, units)
    return LayerCosts(
        tuple(f"u{i}" for i in range(units)),
        fwd,
        fwd * np.exp(rng.uniform(np.log(0.2), np.log(5.0), units)),
        np.where(group >= 0, fwd * rng.uniform(0.5, 1.5, units), 0.0),
        act,
        np.where(group >= 0, act * 0.1, act),
        rng.uniform(1, 5, units),
        rng.uniform(100, 400, units),
        group,
    )


def brute(problem, pp):
    """Every boundary choice x every recompute count pair per stage; objective and sim step."""
    c, u = problem.costs, problem.units
    best_obj, best_step = np.inf, np.inf
    for cuts in itertools.combinations(range(1, u), pp - 1):
        bounds = (0, *cuts, u)
        fwd, bwd, ok = [], [], True
        for s, (lo, hi) in enumerate(itertools.pairwise(bounds)):
            n = inflight_1f1b(s, pp, problem.m)
            groups = sorted({int(g) for g in c.group[lo:hi] if g >= 0})
            sizes = [int(np.sum(c.group[lo:hi] == g)) for g in groups]
            opts = []
            for combo in itertools.product(*[range(k + 1) for k in sizes]):
                cnt = dict(zip(groups, combo, strict=True))
                if stage_memory_mib(c, lo, hi, cnt, n) <= problem.budget + 1e-6:
                    opts.append(stage_time_ms(c, lo, hi, cnt))
            if not opts:
                ok = False
                break
            f, b = min(opts, key=sum)
            fwd.append(f)
            bwd.append(b)
        if not ok:
            continue
        t = np.array(fwd) + np.array(bwd)
        best_obj = min(best_obj, problem.objective(t, bounds))
        p2p = problem.p2p[list(cuts)][:, None] if pp > 1 else 0.0
        m = problem.m
        step = simulate(
            np.repeat(np.array(fwd)[:, None], m, 1),
            np.repeat(np.array(bwd)[:, None], m, 1),
            pp,
            1,
            p2p,
        ).makespan_ms
        best_step = min(best_step, step)
    return best_obj, best_step


@pytest.mark.parametrize("uniform", [False, True])
def test_stage_times_and_choice_match_enumeration(uniform):
    rng = np.random.default_rng(7)
    costs = random_costs(rng, 7, uniform=uniform)
    for n in (1, 3):
        for budget in (800.0, 1500.0, 3000.0):
            problem = Problem(costs, 4, budget)
            table = problem.frontier.stage_times(n, budget)
            for lo, hi in itertools.combinations(range(8), 2):
                want = cheapest_recompute(costs, lo, hi, n, budget)
                got = problem.frontier.choice(lo, hi, n, budget)
                if want is None:
                    assert got is None and table[lo, hi] == np.inf
                else:
                    assert table[lo, hi] == pytest.approx(want[1])
                    assert sum(stage_time_ms(costs, lo, hi, got)) == pytest.approx(want[1])
                    assert stage_memory_mib(costs, lo, hi, got, n) <= budget + 1e-6


@pytest.mark.parametrize("seed", range(60))
def test_search_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    units = int(rng.integers(4, 9))
    pp = int(rng.integers(1, min(units, 5) + 1))
    costs = random_costs(rng, units, uniform=seed % 2 == 1)
    m = int(rng.integers(pp, 4 * pp + 1))
    # a budget between "everything recomputed fits" and "nothing needed", so recompute matters
    total = float(costs.static_mib.sum() + costs.activation_mib.sum() * pp)
    budget = total / pp * rng.uniform(0.6, 1.4)
    problem = Problem(costs, m, budget, rng.uniform(0, 0.5, units + 1))
    want_obj, want_step = brute(problem, pp)
    if not np.isfinite(want_obj):
        with pytest.raises(NoFeasiblePartition):
            search(problem, pp)
        return
    assert min(objective_candidates(problem, pp).values()) == pytest.approx(want_obj, rel=1e-9)
    got = search(problem, pp)
    assert problem.fits(got)
    assert got.step_ms <= want_step * 1.005
    assert got.lower_bound_ms <= want_step * (1 + 1e-9)


def _free_recompute(costs):
    """The same profile with recompute measured as 0 ms (checkpointed minus plain in noise)."""
    return dataclasses.replace(costs, recompute_ms=np.zeros(len(costs)))


@pytest.mark.parametrize("uniform", [False, True])
def test_zero_cost_recompute_is_chosen_only_when_memory_needs_it(uniform):
    """A recompute cost of 0 ties with no recompute: ties go to fewer recomputed layers, so
    with unlimited memory nothing is recomputed, and under a budget the fewest layers that fit
    (the enumeration reference, which breaks ties the same way)."""
    rng = np.random.default_rng(3)
    costs = _free_recompute(random_costs(rng, 9, uniform=uniform))
    for pp in (1, 2, 3):
        part = search(Problem(costs, 4, np.inf), pp)
        assert all(sum(c.values()) == 0 for c in part.recompute), part.recompute
    for n in (1, 3):
        for budget in (900.0, 1500.0):
            problem = Problem(costs, 4, budget)
            for lo, hi in itertools.combinations(range(10), 2):
                want = cheapest_recompute(costs, lo, hi, n, budget)
                got = problem.frontier.choice(lo, hi, n, budget)
                assert (got is None) == (want is None)
                if want is not None:
                    assert sum(got.values()) == sum(want[0].values()), (lo, hi, got, want)
                    assert stage_memory_mib(costs, lo, hi, got, n) <= budget + 1e-6


def test_infeasible_names_stage_and_shortfall():
    costs = LayerCosts(
        ("a", "b", "c"),
        np.ones(3),
        np.ones(3),
        np.ones(3),
        np.full(3, 100.0),
        np.full(3, 10.0),
        np.zeros(3),
        np.array([500.0, 10.0, 10.0]),
        np.zeros(3, int),
    )
    problem = Problem(costs, 4, 300.0)
    with pytest.raises(NoFeasiblePartition, match=r"stage 0 \(a \.\. a\) 0\.\d+ GiB short"):
        search(problem, 3)
    # stage 0 alone holds 500 MiB static + 3 in flight x 10 MiB checkpoints = 530: 230 over
    with pytest.raises(NoFeasiblePartition, match=r"0\.22 GiB short"):
        search(problem, 3)


def test_pp_larger_than_units_is_an_error():
    rng = np.random.default_rng(0)
    problem = Problem(random_costs(rng, 5), 4)
    with pytest.raises(ValueError, match="pipeline size 6 is larger than the 5 partition units"):
        search(problem, 6)


def test_megatron_default_layout():
    group = np.array([0] * 6 + [-1] + [1] * 10)
    n = len(group)
    costs = LayerCosts(
        tuple(map(str, range(n))),
        np.ones(n),
        np.ones(n),
        np.ones(n),
        np.ones(n),
        np.zeros(n),
        np.zeros(n),
        np.ones(n),
        group,
    )
    part = megatron_default(Problem(costs, 8), 4)
    assert part.bounds == (0, 7 + 2, 9 + 2, 11 + 3, 17)
    assert part.recompute[0] == {0: 6, 1: 2}  # everything recomputed on every stage
    assert part.recompute[3] == {1: 3}


@pytest.mark.parametrize("seed", range(5))
def test_bmp_never_beats_the_exact_objective(seed):
    rng = np.random.default_rng(100 + seed)
    problem = Problem(random_costs(rng, 12), 8)
    heuristic = bmp(problem, 4)
    assert heuristic.objective_ms >= min(objective_candidates(problem, 4).values()) - 1e-9
    assert heuristic.step_ms >= search(problem, 4).lower_bound_ms


def test_megatron_default_on_a_profile_without_towers_splits_evenly():
    n = 10
    costs = LayerCosts(
        tuple(map(str, range(n))),
        np.ones(n),
        np.ones(n),
        np.ones(n),
        np.ones(n),
        np.zeros(n),
        np.zeros(n),
        np.ones(n),
        np.zeros(n, int),
    )
    assert megatron_default(Problem(costs, 4), 4).bounds == (0, 2, 4, 7, 10)


def test_longest_paths_match_the_simulator_and_their_critical_paths():
    """The vectorised step equals the event-driven simulation; the critical path's signature,
    priced with the same times, gives the step back (so it is a valid lower-bound plane)."""
    rng = np.random.default_rng(3)
    for _ in range(60):
        pp, m = int(rng.integers(1, 7)), int(rng.integers(1, 10))
        f = rng.uniform(0.1, 3, (3, pp))
        b = f * rng.uniform(0.2, 4, (3, pp))
        c = rng.uniform(0, 1, (3, pp - 1))
        span, sigs = longest_paths(pipeline_graph(pp, m), f, b, c, paths=True)
        for i in range(3):
            link = c[i][:, None] if pp > 1 else 0.0
            rep = np.repeat(f[i][:, None], m, 1), np.repeat(b[i][:, None], m, 1)
            want = simulate(*rep, pp, 1, link).makespan_ms
            assert span[i] == pytest.approx(want, rel=1e-12)
            g = sigs[i]
            priced = g.forwards @ f[i] + g.backwards @ b[i] + np.dot(g.crossings[: pp - 1], c[i])
            assert priced == pytest.approx(want, rel=1e-12)
            assert g.crossings[pp - 1] == 0


# seeds 61 and 176: the DPs + polish alone (tolerance=None) end 7.4% and 3.0% above the optimum
@pytest.mark.parametrize("seed", [*range(40), 61, 176])
def test_search_is_certified_optimal_on_harsh_profiles(seed):
    """Fewer micro-batches than stages and very different forward/backward ratios per layer
    (where the DPs alone missed the simulated optimum by 2-7%): brute force over every
    partition and recompute choice, each simulated exactly."""
    rng = np.random.default_rng(1000 + seed)
    units = int(rng.integers(5, 10))
    pp = int(rng.integers(2, min(units, 6) + 1))
    m = int(rng.integers(1, pp)) if seed % 2 == 0 else int(rng.integers(pp, 2 * pp + 1))
    costs = harsh_costs(rng, units)
    total = float(costs.static_mib.sum() + costs.activation_mib.sum() * pp)
    problem = Problem(costs, m, total / pp * rng.uniform(0.7, 1.6), rng.uniform(0, 0.5, units + 1))
    _, want = brute(problem, pp)
    if not np.isfinite(want):
        with pytest.raises(NoFeasiblePartition):
            search(problem, pp)
        return
    got = search(problem, pp)
    assert problem.fits(got)
    assert got.step_ms <= want * 1.005
    assert got.lower_bound_ms <= want * (1 + 1e-9)
    assert got.step_ms <= got.lower_bound_ms * (1 + 1e-3) + 1e-9  # the certificate
    exact = search(problem, pp, tolerance=0.0)
    assert exact.step_ms == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_branch_and_bound_from_the_worst_split_reaches_the_optimum(seed):
    """Seeded with the slowest feasible split instead of the DPs' pick, branch and bound
    alone must still reach the brute-force optimum (tolerance 0) and bound it from below."""
    rng = np.random.default_rng(500 + seed)
    units = int(rng.integers(5, 9))
    pp = int(rng.integers(2, min(units, 5) + 1))
    problem = Problem(harsh_costs(rng, units), int(rng.integers(1, 2 * pp + 1)))
    tables = problem.tables(pp)
    forward = forward_table(problem.costs)
    backward = [t - np.where(np.isfinite(t), forward, 0.0) for t in tables]
    splits = [(0, *c, units) for c in itertools.combinations(range(1, units), pp - 1)]
    steps = [problem.evaluate(b).step_ms for b in splits]
    worst = splits[int(np.argmax(steps))]
    cert = certify(forward, backward, problem.p2p, problem.m, worst, tolerance=0.0)
    assert cert.complete
    assert cert.step_ms == pytest.approx(min(steps), rel=1e-9)
    assert problem.evaluate(cert.bounds).step_ms == pytest.approx(min(steps), rel=1e-9)
    assert cert.lower_bound_ms <= min(steps) * (1 + 1e-9)


FIELDS = ("forwards", "backwards", "crossings")


def test_closed_form_signatures_never_exceed_the_longest_path():
    """The bottleneck and fill-drain families seed the bound without being simulated, so
    each must be a real path: priced with any stage times, never above the exact step."""
    rng = np.random.default_rng(9)
    for _ in range(80):
        pp = int(rng.integers(2, 11))
        m = int(rng.integers(1, pp + 1)) if rng.random() < 0.7 else int(rng.integers(pp, 3 * pp))
        sigs = bottleneck_signatures(pp, m) + fill_drain_signatures(pp, m)
        f, b = np.exp(rng.normal(0, 1.5, (2, 32, pp)))
        c = np.exp(rng.normal(-1, 1.5, (32, pp - 1)))
        span, _ = longest_paths(pipeline_graph(pp, m), f, b, c)
        nf, nb, nc = (np.array([getattr(g, k) for g in sigs]) for k in FIELDS)
        priced = f @ nf.T + b @ nb.T + c @ nc[:, : pp - 1].T
        assert np.all(priced <= span[:, None] * (1 + 1e-12))
