"""A plan's invariants against its data: every sample once, every pack within its level's
budgets. balance() runs this before returning a plan and `omnibal balance` before writing one,
so a plan that could run out of memory or lose a sample is never handed on."""

from __future__ import annotations

import numpy as np

from megatron_omnibal.balance.plan_io import BalancePlan
from megatron_omnibal.data.lengths import LengthStats


class PlanError(ValueError):
    """A balance plan breaks an invariant; the message names the pack or sample."""


def gather_rows(rows: np.ndarray, index: np.ndarray) -> np.ndarray:
    """rows[index] for a (n, k) array, each row fetched as one item: a random gather costs by
    the items it fetches far more than by their bytes (numpy's row-wise fancy index is slower
    still). Rows of 16 bytes (two 8-byte values) are the case numpy copies fastest."""
    rows = np.ascontiguousarray(rows)
    item = np.dtype((np.void, rows.strides[0]))
    return rows.view(item).ravel()[index].view(rows.dtype).reshape(len(index), rows.shape[1])


def pack_sums(values: np.ndarray, samples: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """Per pack (pack p = samples[ptr[p]:ptr[p+1]]): the sum of `values` over its samples, in
    the values' own type (integers stay exact), 0 for an empty pack. `values` of shape
    (samples, 2) give both sums, (packs, 2), from one gather (gather_rows)."""
    values = np.asarray(values)
    picked = gather_rows(values, samples) if values.ndim == 2 else values[samples]
    out = np.zeros((len(ptr) - 1, *picked.shape[1:]), picked.dtype)
    filled = np.flatnonzero(np.diff(ptr) > 0)
    if len(filled):
        out[filled] = np.add.reduceat(picked, ptr[filled], axis=0)
    return out


def pack_totals(plan: BalancePlan, values: np.ndarray) -> np.ndarray:
    """Per pack: the sum of `values` over its samples."""
    pid = np.repeat(np.arange(plan.num_packs), np.diff(plan.pack_ptr))
    return np.bincount(pid, np.asarray(values, np.float64)[plan.samples], plan.num_packs)


def check_plan(plan: BalancePlan, lengths: LengthStats) -> None:
    """Raise PlanError unless the plan covers the data exactly once on a full grid and every
    pack keeps its level's budgets; a pack over them is allowed only as oversize='solo' makes
    it: one sample, itself over the budgets of every level."""
    try:
        plan.check(len(lengths))
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
    levels = plan.meta.get("levels") or [{"vit_budget": plan.meta["vit_budget"],
                                          "token_budget": plan.meta["token_budget"]}]
    vb = np.array([int(lv["vit_budget"]) for lv in levels])[plan.pack_level]
    tb = np.array([int(lv["token_budget"]) for lv in levels])[plan.pack_level]
    tiles, tokens = pack_sums(np.stack([lengths.vit, lengths.tokens], axis=1), plan.samples,
                              plan.pack_ptr).T
    over = (tiles > vb) | (tokens > tb)
    if not over.any():
        return
    sizes = np.diff(plan.pack_ptr)
    top_v, top_t = int(levels[-1]["vit_budget"]), int(levels[-1]["token_budget"])
    for p in np.flatnonzero(over):
        sample = int(plan.pack(p)[0]) if sizes[p] else -1
        solo = plan.meta.get("oversize") == "solo" and sizes[p] == 1 and (
            lengths.vit[sample] > top_v or lengths.tokens[sample] > top_t)
        if not solo:
            raise PlanError(
                f"plan: pack {int(p)} (step {int(plan.pack_step[p])}, rank "
                f"{int(plan.pack_rank[p])}, micro {int(plan.pack_micro[p])}) holds "
                f"{int(tiles[p])} tiles / {int(tokens[p])} tokens, over its budgets "
                f"{int(vb[p])} / {int(tb[p])}")
