"""Pictures where a table hides the point: how lengths are distributed, how balanced a plan is.

`plot_stats`: per dataset, the distributions of tiles and tokens per sample (what a balancer has
to pack). `plot_balance`: per training step, the spread across data-parallel ranks of the tiles
and tokens each rank runs, for the plan and for random batching of the same samples: the
straggler rank sets the step time, so the band's top edge is what matters.

Both write a PNG with matplotlib's Agg backend (no display needed) and return its path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from megatron_omnibal.data.lengths import LengthStats

MAX_STEPS = 200  # steps drawn per plan (more become an unreadable band)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_stats(stats: LengthStats, path: str | os.PathLike) -> Path:
    """Histograms of tiles and tokens per sample, one colour per dataset."""
    plt = _pyplot()
    fig, (ax_tiles, ax_tokens) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = stats.names
    tiles = [stats.vit[stats.dataset == d] for d in range(len(names))]
    tokens = [stats.tokens[stats.dataset == d] for d in range(len(names))]
    top = int(stats.vit.max()) if len(stats) else 1
    ax_tiles.hist(tiles, bins=np.arange(-0.5, top + 1.5, 1), stacked=True, label=list(names))
    ax_tiles.set(title="image tiles per sample", xlabel="tiles (vit_num)", ylabel="samples")
    ax_tokens.hist(tokens, bins=60, stacked=True, label=list(names))
    ax_tokens.set(title="tokens per sample", xlabel="tokens (token_num)", ylabel="samples")
    for ax in (ax_tiles, ax_tokens):
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{len(stats):,} samples in {len(names)} dataset(s): mean "
                 f"{stats.vit.mean():.2f} tiles, {stats.tokens.mean():.0f} tokens")
    return _save(fig, plt, path)


def per_rank_load(plan: Any, lengths: LengthStats) -> tuple[np.ndarray, np.ndarray]:
    """(tiles, tokens) per [step, dp rank], summed over the rank's micro-batches."""
    steps, ranks = plan.num_steps, int(plan.meta["dp"])
    sizes = np.diff(plan.pack_ptr)
    owner = np.repeat(np.arange(plan.num_packs), sizes)
    cell = plan.pack_step[owner] * ranks + plan.pack_rank[owner]
    out = []
    for values in (lengths.vit, lengths.tokens):
        grid = np.bincount(cell, weights=values[plan.samples], minlength=steps * ranks)
        out.append(grid.reshape(steps, ranks))
    return out[0], out[1]


def plot_balance(plan: Any, baseline: Any, lengths: LengthStats,
                 path: str | os.PathLike) -> Path:
    """Per step: min..max band and mean across DP ranks, plan beside random batching."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 7), sharex="col", sharey="row")
    for col, (label, p) in enumerate((("balanced plan", plan), ("random batching", baseline))):
        tiles, tokens = per_rank_load(p, lengths)
        for row, (what, grid) in enumerate((("tiles", tiles), ("tokens", tokens))):
            ax = axes[row, col]
            shown = grid[:MAX_STEPS]
            x = np.arange(len(shown))
            if len(shown):
                ax.fill_between(x, shown.min(1), shown.max(1), alpha=0.3, step="mid",
                                label="min..max over ranks")
                ax.plot(x, shown.mean(1), drawstyle="steps-mid", lw=1, label="mean")
                ratio = (grid.max(1) / np.maximum(grid.mean(1), 1e-9)).mean()
                ax.set_title(f"{label}: {what} per rank (max/mean {ratio:.3f})")
            ax.set(ylabel=f"{what} per rank per step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small", loc="lower right")
        axes[1, col].set_xlabel(f"step (first {min(MAX_STEPS, p.num_steps)} of {p.num_steps})")
    fig.suptitle(f"{len(lengths):,} samples, DP {plan.meta['dp']}, "
                 f"{plan.meta['micro_batches']} micro-batch(es) per rank per step")
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
