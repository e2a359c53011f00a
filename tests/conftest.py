"""Fixtures several test modules share."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_omnibal.data.lengths import load_lengths, read_stats_config, save_lengths
from tests.helpers.dp_runs import dp2_training

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data" / "internvl_subset.npz"

# The longest test files, started first: `make test` hands whole files to its two pytest-xdist
# workers in collection order, so a long file collected last would run alone at the end.
LONGEST_FIRST = (
    "tests/scripts/test_demo.py",
    "tests/workflow/test_finetune.py",
    "tests/megatron/training/test_megatron_vpp.py",
    "tests/megatron/checkpoint/test_hf_convert.py",
    "tests/preflight/test_preflight_config.py",
    "tests/preflight/test_preflight.py",
    "tests/megatron/checkpoint/test_hf_import.py",
    "tests/megatron/training/test_megatron_training.py",
    "tests/megatron/checkpoint/test_lora_export.py",
    "tests/megatron/training/test_megatron_lora_resume.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of LONGEST_FIRST first, in that order; the rest, and every file's own tests,
    in collection order (a stable sort)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = Path(config.rootpath)

    def key(item: pytest.Item) -> int:
        return rank.get(Path(item.path).relative_to(root).as_posix(), len(rank))

    items.sort(key=key)


@pytest.fixture(scope="session")
def lengths_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 real records of the example data (counted at 256 image tokens per tile, as the
    example's stored configuration says): a few balanced steps per epoch. Read only: one file
    for the session."""
    real = load_lengths(EXAMPLE)
    pick = np.sort(np.random.default_rng(1).choice(len(real), 40, replace=False))
    path = tmp_path_factory.mktemp("lengths") / "lengths.npz"
    save_lengths(real.subset(pick), path, config=read_stats_config(EXAMPLE))
    return path


@pytest.fixture(scope="session")
def dp2_run(lengths_file: Path, tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """tests/helpers/dp_runs.py's DP=2 epoch, launched once for the session: the tests of
    megatron/training/test_megatron_training.py (samples, resume) and
    megatron/checkpoint/test_megatron_checkpoint.py (log, TensorBoard) read the same run."""
    return dp2_training(lengths_file, tmp_path_factory.mktemp("dp2"))
