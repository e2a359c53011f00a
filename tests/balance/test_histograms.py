"""Sparse per-group histograms against the dense groups x values table they replace."""

import numpy as np
import pytest

from megatron_omnibal.balance import histograms


def _dense(group, value, groups, values):
    return np.bincount(group * values + value, minlength=groups * values).reshape(groups, values)


@pytest.mark.parametrize("seed", range(6))
def test_most_frequent_is_the_dense_argmax(seed):
    rng = np.random.default_rng(seed)
    groups, values = int(rng.integers(1, 40)), int(rng.integers(1, 7))
    group = np.sort(rng.integers(0, groups, int(rng.integers(0, 300))))
    value = rng.integers(0, values, len(group))
    want = _dense(group, value, groups, values).argmax(axis=1)  # ties: smallest; empty: 0
    assert histograms.most_frequent(group, value, groups, values).tolist() == want.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_total_variation_is_the_dense_sum(seed):
    rng = np.random.default_rng(seed)
    groups, values = int(rng.integers(1, 30)), int(rng.integers(1, 9))
    group = rng.integers(0, groups, int(rng.integers(1, 400)))  # unsorted works too
    value = rng.integers(0, values, len(group))
    hist = _dense(group, value, groups, values).astype(float)
    p = hist.sum(axis=0) / hist.sum()
    rows = hist.sum(axis=1)
    want = [0.5 * np.abs(h / r - p).sum() if r else 0.0 for h, r in zip(hist, rows, strict=True)]
    got = histograms.total_variation(group, value, groups, values)
    assert got == pytest.approx(want, abs=1e-12)


def test_empty_input():
    empty = np.zeros(0, np.int64)
    assert histograms.most_frequent(empty, empty, 3, 2).tolist() == [0, 0, 0]
    assert histograms.total_variation(empty, empty, 2, 2).tolist() == [0.0, 0.0]
