"""Fixtures several test modules share."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron_omnibal.data.lengths import load_lengths, read_stats_config, save_lengths

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data" / "internvl_subset.npz"


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 real records of the example data (counted at 256 image tokens per tile, as the
    example's stored configuration says): a few balanced steps per epoch."""
    real = load_lengths(EXAMPLE)
    pick = np.sort(np.random.default_rng(1).choice(len(real), 40, replace=False))
    path = tmp_path_factory.mktemp("lengths") / "lengths.npz"
    save_lengths(real.subset(pick), path, config=read_stats_config(EXAMPLE))
    return path
