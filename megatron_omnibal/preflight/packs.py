"""The micro-batches a preflight trains: the largest each packing level's budgets allow, with
`--calibrate` a spread of sizes up to it, then typical ones from the balanced stream.

Why the largest: a stage's activation memory grows with the tiles and tokens of each micro-batch
it holds, and no balanced pack exceeds its level's budgets (the `solo` oversize policy aside, whose
samples the length file names). A step whose every micro-batch is one sample filling both budgets
(as many real tiles as the tokens hold, every other token text) therefore bounds every stage's
in-flight memory under any schedule order, and its single long sample bounds attention too.

Why a spread: balanced micro-batches and the largest one differ little in size (within ~20%), too
little to tell a layer's time per token from its attention's time per squared length; a fit
that cannot tell them apart extrapolates wildly to longer micro-batches (a padded baseline's
run up to ~1.7 times the token budget). One sample each at 1/m, 2/m, .., m/m of the largest
spans a factor m (run twice, rising and falling: preflight/run.py). Pure numpy: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_omnibal.balance.config import Level
from megatron_omnibal.data.lengths import LengthStats, from_arrays


@dataclass(frozen=True, kw_only=True)
class WorstPack:
    """One packing level's largest micro-batch: one sample of `tiles` real tiles, `tokens`."""

    level: int
    tiles: int
    tokens: int
    micro_batches: int

    def __post_init__(self) -> None:
        if self.level < 0 or self.tiles < 0 or self.tokens < 2 or self.micro_batches < 1:
            raise ValueError(f"WorstPack: bad figures {self}")

    def describe(self) -> str:
        return (f"the largest micro-batch of packing level {self.level}: {self.tiles} image "
                f"tiles and {self.tokens} tokens in one sample")  # fmt: skip


def worst_packs(levels: tuple[Level, ...], tokens_per_tile: int) -> tuple[WorstPack, ...]:
    """Per packing level, the micro-batch that fills both its budgets (see the module doc)."""
    if tokens_per_tile < 1:
        raise ValueError(f"tokens_per_tile must be >= 1, got {tokens_per_tile}")
    out = []
    for index, lv in enumerate(levels):
        if lv.token_budget < 2:
            raise ValueError(f"packing level {index}: a token budget of {lv.token_budget} holds "
                             "no sample (a sample has at least 2 tokens)")  # fmt: skip
        tiles = min(lv.vit_budget, (lv.token_budget - 2) // tokens_per_tile)
        out.append(WorstPack(level=index, tiles=tiles, tokens=lv.token_budget,
                             micro_batches=lv.micro_batches))  # fmt: skip
    return tuple(out)


def spread_packs(pack: WorstPack, tokens_per_tile: int) -> tuple[WorstPack, ...]:
    """The spread step's micro-batches of `pack`'s level: micro-batch k (of the level's m) one
    sample of k/m of its tokens (at least 2) and as many of its tiles as those tokens hold."""
    m = pack.micro_batches
    out = []
    for k in range(1, m + 1):
        tokens = max(2, round(pack.tokens * k / m))
        tiles = min(round(pack.tiles * k / m), (tokens - 2) // tokens_per_tile)
        out.append(WorstPack(level=pack.level, tiles=tiles, tokens=tokens, micro_batches=m))
    return tuple(out)


def worst_lengths(packs: tuple[WorstPack, ...]) -> LengthStats:
    """Length records of the worst packs' samples (record i is packs[i]'s one sample)."""
    return from_arrays([p.tiles for p in packs], [p.tokens for p in packs],
                       [p.tiles for p in packs])  # fmt: skip
