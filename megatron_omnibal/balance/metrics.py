"""How balanced a plan is: per-step load across data-parallel ranks, padding, dataset mix.

Every rank waits for the slowest at each step, so what matters is, per step, the largest rank
load over the mean rank load (1.0 is perfect), for each kind of work: image tiles (vision
encoder), tokens (LLM) and the modeled time of a PackCost (by default the LLM cost of
a 2048-wide model: tokens + sum(len^2) / (6 x 2048), Megatron's per-layer FLOPs in units of a
token; `omnibal plan`'s cost model gives real milliseconds).
OmniBal reports the same imbalance as a "dist ratio": sum over ranks of (max - x) / (ranks * max),
the share of rank-time spent waiting. Its "pad ratio" is the share of padding when each
micro-batch's sequences are padded to its longest (a pack is one packed sequence).

The dataset-mix skew of a step is the total-variation distance between the step's histogram of
source datasets and the whole epoch's: 0.5 * sum_d |p_step(d) - p(d)|. Small steps are skewed
by chance alone, so it is reported beside the same measure for a plain shuffle cut into steps of
the same sizes; a ratio near 1 means "as random as a shuffle".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_omnibal.balance import histograms
from megatron_omnibal.balance.config import DEFAULT_COST, PackCost
from megatron_omnibal.balance.core import permutation
from megatron_omnibal.balance.plan_io import BalancePlan
from megatron_omnibal.data.lengths import LengthStats

_SHUFFLE_SALT = 0x534B4557  # "SKEW"


@dataclass(frozen=True)
class StepLoads:
    """Per (step, rank) sums over the rank's micro-batches: arrays of shape [steps, dp]."""

    tiles: np.ndarray
    tokens: np.ndarray
    time: np.ndarray


def _sample_index(plan: BalancePlan) -> tuple[np.ndarray, np.ndarray]:
    """(pack of each entry of plan.samples, step of each entry)."""
    sizes = np.diff(plan.pack_ptr)
    pack = np.repeat(np.arange(plan.num_packs), sizes)
    return pack, plan.pack_step[pack]


def step_loads(plan: BalancePlan, lengths: LengthStats, cost: PackCost = DEFAULT_COST
               ) -> StepLoads:
    """Tiles, tokens and modeled time each rank carries at each step."""
    dp = int(plan.meta["dp"])
    steps = plan.num_steps
    pack, _ = _sample_index(plan)
    slot = plan.pack_step[pack] * dp + plan.pack_rank[pack]
    s = plan.samples

    def total(values: np.ndarray) -> np.ndarray:
        return np.bincount(slot, values, steps * dp).reshape(steps, dp)

    return StepLoads(total(lengths.vit[s].astype(np.float64)),
                     total(lengths.tokens[s].astype(np.float64)),
                     total(cost.sample_ms(lengths.vit[s], lengths.tokens[s])))


def max_over_mean(load: np.ndarray) -> np.ndarray:
    """Per step (row): max / mean across ranks; 1.0 for a step with no load."""
    mean = load.mean(axis=1)
    out = np.ones(len(load))
    nz = mean > 0
    out[nz] = load[nz].max(axis=1) / mean[nz]
    return out


def dist_ratio(load: np.ndarray) -> np.ndarray:
    """Per step: OmniBal's sum over ranks of (max - x) / (ranks * max); 0.0 for an empty step."""
    top = load.max(axis=1)
    out = np.zeros(len(load))
    nz = top > 0
    out[nz] = (top[nz, None] - load[nz]).sum(axis=1) / (load.shape[1] * top[nz])
    return out


def pad_ratio(plan: BalancePlan, lengths: LengthStats, packed: bool = True) -> float:
    """Padding share when each micro-batch's sequences are padded to its longest one. A pack is
    one packed sequence (packed=True, no padding); packed=False treats its samples as separate
    sequences (plain batching)."""
    if packed or plan.num_packs == 0:
        return 0.0
    pack, _ = _sample_index(plan)
    tok = lengths.tokens[plan.samples].astype(np.float64)
    longest = np.zeros(plan.num_packs)
    np.maximum.at(longest, pack, tok)
    sizes = np.diff(plan.pack_ptr)
    slots = float((longest * sizes).sum())
    return float(1.0 - tok.sum() / slots) if slots else 0.0


def step_mix_skew(plan: BalancePlan, lengths: LengthStats) -> np.ndarray:
    """Per step: total-variation distance of its dataset histogram from the epoch's."""
    _, step = _sample_index(plan)
    return histograms.total_variation(step, lengths.dataset[plan.samples], plan.num_steps,
                                      len(lengths.names))


def shuffle_mix_skew(plan: BalancePlan, lengths: LengthStats, seed: int = 0) -> np.ndarray:
    """The same measure for the plan's samples in a plain random order, cut into steps of the
    plan's step sizes (in sample count)."""
    _, step = _sample_index(plan)
    sizes = np.bincount(step, minlength=plan.num_steps)
    order = permutation(len(plan.samples), seed ^ _SHUFFLE_SALT)
    shuffled_step = np.repeat(np.arange(plan.num_steps), sizes)
    ds = lengths.dataset[plan.samples][order]
    return histograms.total_variation(shuffled_step, ds, plan.num_steps, len(lengths.names))


def summarize(plan: BalancePlan, lengths: LengthStats, cost: PackCost = DEFAULT_COST,
              packed: bool = True, seed: int = 0) -> dict[str, float]:
    """All figures of one plan, averaged over steps (and as the 99th percentile)."""
    loads = step_loads(plan, lengths, cost)
    out: dict[str, float] = {}
    for name in ("tiles", "tokens", "time"):
        load = getattr(loads, name)
        mm = max_over_mean(load)
        out[f"{name}_max_mean"] = float(mm.mean())
        out[f"{name}_max_mean_p99"] = float(np.percentile(mm, 99))
        out[f"{name}_dist_ratio"] = float(dist_ratio(load).mean())
    out["pad_ratio"] = pad_ratio(plan, lengths, packed)
    skew = step_mix_skew(plan, lengths)
    base = shuffle_mix_skew(plan, lengths, seed)
    out["mix_skew"] = float(skew.mean())
    out["mix_skew_shuffle"] = float(base.mean())
    out["mix_skew_ratio"] = out["mix_skew"] / out["mix_skew_shuffle"] if base.mean() else 1.0
    out["steps"] = float(plan.num_steps)
    out["samples_per_step"] = len(plan.samples) / plan.num_steps if plan.num_steps else 0.0
    out["trained_samples"] = float(len(plan.samples))
    out["skipped_samples"] = float(len(plan.skipped))
    out["empty_packs"] = float(np.sum(np.diff(plan.pack_ptr) == 0))
    return out


def random_batching(lengths: LengthStats, *, dp_size: int, micro_batches: int,
                    samples_per_micro: int, seed: int = 0) -> BalancePlan:
    """The usual baseline: shuffled samples, fixed samples per micro-batch, laid out in order
    over (step, rank, micro). Samples that do not fill a whole step are left out (as a
    drop-last data loader would); they are listed in `skipped`."""
    if samples_per_micro < 1:
        raise ValueError(f"random_batching: samples_per_micro must be >= 1, "
                         f"got {samples_per_micro}")
    order = permutation(len(lengths), seed)
    per_step = dp_size * micro_batches * samples_per_micro
    steps = len(order) // per_step
    used = order[: steps * per_step]
    packs = steps * dp_size * micro_batches
    slot = np.arange(packs)
    return BalancePlan(
        samples=used.astype(np.int64),
        pack_ptr=np.arange(packs + 1, dtype=np.int64) * samples_per_micro,
        pack_step=slot // (dp_size * micro_batches),
        pack_rank=(slot // micro_batches) % dp_size,
        pack_micro=slot % micro_batches,
        skipped=order[steps * per_step:].astype(np.int64),
        meta={"dp": dp_size, "micro_batches": micro_batches, "algorithm": "random-batching",
              "samples_per_micro": samples_per_micro, "seed": seed},
    )
