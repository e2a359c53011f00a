"""Gantt chart of a simulated pipeline step: one row per rank, forward and backward bars.

Idle gaps between bars are the bubbles; seeing where they sit (warm-up, drain, or behind a slow
stage) says whether the partition or the data is to blame.
"""

from __future__ import annotations

from pathlib import Path

from megatron_omnibal.planner.simulator.simulate import Timeline


def save_gantt(timeline: Timeline, path: str | Path, title: str = "") -> None:
    """Write the chart as PNG (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not timeline.ops:
        raise ValueError("gantt: the timeline holds no operations (simulate with keep_ops=True)")
    pp = timeline.pp
    fig, ax = plt.subplots(figsize=(14, 0.5 * pp + 1.8), dpi=110)
    colours = {"F": ("#4c72b0", "#8fb0dc"), "B": ("#dd8452", "#f0b892")}
    span = timeline.makespan_ms
    for op in timeline.ops:
        colour = colours[op.kind][op.chunk % 2]
        ax.barh(
            op.rank,
            op.end - op.start,
            left=op.start,
            height=0.8,
            color=colour,
            edgecolor="white",
            linewidth=0.3,
        )
        if (op.end - op.start) > span / 60:
            ax.text(
                (op.start + op.end) / 2,
                op.rank,
                str(op.micro_batch),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks(range(pp))
    ax.set_yticklabels(
        [f"stage {r}  ({100 * timeline.busy_ms[r] / span:.0f}% busy)" for r in range(pp)]
    )
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel("time (ms)")
    ax.set_title(
        title or f"pipeline step {span:.1f} ms, bubble {timeline.bubble_fraction:.1%}",
        loc="left",
        fontsize=10,
    )
    ax.legend(
        handles=[
            Patch(color=colours["F"][0], label="forward"),
            Patch(color=colours["B"][0], label="backward (+ recompute)"),
        ],
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=2,
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
