"""The fits of `--calibrate`: cost coefficients from a preflight's timed micro-batches, and the
point-to-point time that makes the planner's pipeline simulator span what the run measured.

Why fit rather than scale one micro-batch: a layer's time has a part per micro-batch (launches,
the framework's work), a part per tile or token, and attention, which grows with the squared
lengths of the sequences it runs over; the preflight's micro-batches (the largest of a level and
the balanced stream's, which vary in length) separate them. The point-to-point time is what the
measured forwards and backwards leave unexplained of the pipeline's measured span: the waits on
sends and receives and the schedule's own work between passes. Pure numpy.
"""

from __future__ import annotations

import itertools

import numpy as np

from megatron_omnibal.planner.simulator.simulate import simulate


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Coefficients c >= 0 minimising |x c - y|^2 (x: (n, k) with few columns).

    Exact: the optimum is the unconstrained least squares on its own support, so the best
    non-negative solution over every subset of columns is it. Columns are scaled to unit norm
    first (tiles, tokens and squared lengths differ by orders of magnitude)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise ValueError(f"nonnegative_least_squares: x {x.shape} and y {y.shape} do not match")
    norm = np.linalg.norm(x, axis=0)
    norm[norm == 0] = 1.0
    scaled = x / norm
    best, best_error = np.zeros(x.shape[1]), float(y @ y)
    for size in range(1, x.shape[1] + 1):
        for cols in itertools.combinations(range(x.shape[1]), size):
            c, *_ = np.linalg.lstsq(scaled[:, cols], y, rcond=None)
            if np.any(c < 0):
                continue
            error = float(np.sum((scaled[:, cols] @ c - y) ** 2))
            if error < best_error * (1 - 1e-12):
                best, best_error = np.zeros(x.shape[1]), error
                best[list(cols)] = c
    return best / norm


def supported_fit(x: np.ndarray, y: np.ndarray, always: int = 1) -> np.ndarray:
    """The non-negative least-squares fit of y on its first `always` columns (the terms the
    work is known to have: a time per tile or token, and for attention one per squared length)
    and those other columns the measurements support: of the subsets holding the first ones,
    the one with the lowest Bayesian information criterion (n log(RSS / n) + k log n, k its
    non-zero coefficients), where an optional term may not zero column 0.

    Balanced micro-batches differ little in size, so on noisy times a term the data cannot
    separate (a fixed part beside the per-token one) is left out rather than fitted to the
    noise, which would skew every micro-batch of another size. A residual within rounding of 0
    counts as 0 (exact data: the fewest exact terms)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    n, k = x.shape
    if not 1 <= always <= k:
        raise ValueError(f"supported_fit: always must be within 1..{k}, got {always}")
    floor = max(1e-20 * float(y @ y), 1e-300)
    best, best_score = np.zeros(k), np.inf
    for size in range(k - always + 1):
        for others in itertools.combinations(range(always, k), size):
            cols = [*range(always), *others]
            c = np.zeros(k)
            c[cols] = nonnegative_least_squares(x[:, cols], y)
            if c[0] <= 0 and others:
                continue
            rss = max(float(np.sum((x @ c - y) ** 2)), floor)
            score = n * np.log(rss / n) + np.count_nonzero(c) * np.log(n)
            if score < best_score - 1e-9:
                best, best_score = c, score
    return best


def fit_p2p_ms(forward_ms: np.ndarray, backward_ms: np.ndarray, span_ms: float) -> float:
    """The transfer time per stage boundary and micro-batch (each direction) with which 1F1B
    over these (pp, m) measured forwards and backwards spans `span_ms`, from the first stage's
    first forward to its last backward; 0 when the passes alone span as much."""
    forward, backward = np.asarray(forward_ms, np.float64), np.asarray(backward_ms, np.float64)
    pp = forward.shape[0]

    def makespan(p2p: float) -> float:
        return simulate(forward, backward, pp, 1, p2p, keep_ops=False).makespan_ms

    if pp < 2 or makespan(0.0) >= span_ms:
        return 0.0
    # the last backward waits for 2 (pp - 1) >= 2 transfers: p2p = span overshoots
    low, high = 0.0, float(span_ms)
    while high - low > 1e-9 * span_ms:
        mid = (low + high) / 2
        low, high = (mid, high) if makespan(mid) < span_ms else (low, mid)
    return (low + high) / 2
