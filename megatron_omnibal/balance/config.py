"""BalanceConfig: everything that decides a balance plan, validated once, passed whole.

Both command lines build one (`omnibal balance`, pretrain_vlm's --omnibal-* flags through
megatron/flags/args.py) and hand it to `balance()`, the sampler and, as a parameter struct, the C++
core. A plan is a pure function of (lengths, config): every data-parallel rank computing it gets
the same plan. The config goes into the plan file's meta, so a plan records how it was made.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import numpy as np

ALGORITHMS = ("default", "isf")
MODES = ("random", "grouped")
OVERSIZE = ("error", "solo", "skip")
ISF_THRESHOLD_MARGIN = 128  # ISF's default full pack: token budget - this (OmniBal's search)


def _check_int(where: str, name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{where}: {name} must be an integer >= {low}, got {value!r}")


def _check_choice(where: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{where}: unknown {name} '{value}' (choose from {', '.join(allowed)})")


@dataclass(frozen=True, kw_only=True)
class PackCost:
    """Modeled time (ms) of a pack on each pipeline stage, per sample summed over the pack:
    tile_ms[s] * tiles + token_ms[s] * tokens + attention_ms[s] * tokens^2 (attention in a pack
    is block-diagonal: its cost is the sum of its samples' squared lengths, not the square of
    the sum). One stage (tuples of length 1) describes a whole model. The balancer balances the
    sum over stages: the work a data-parallel replica does for the pack."""

    tile_ms: tuple[float, ...]
    token_ms: tuple[float, ...]
    attention_ms: tuple[float, ...]

    def __post_init__(self) -> None:
        for name in ("tile_ms", "token_ms", "attention_ms"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
        sizes = {len(self.tile_ms), len(self.token_ms), len(self.attention_ms)}
        if len(sizes) != 1 or not self.tile_ms:
            raise ValueError("PackCost: tile_ms, token_ms and attention_ms need one value per "
                             f"stage each (got {len(self.tile_ms)}, {len(self.token_ms)}, "
                             f"{len(self.attention_ms)})")
        values = self.tile_ms + self.token_ms + self.attention_ms
        if any(not np.isfinite(x) or x < 0 for x in values) or sum(values) <= 0:
            raise ValueError(f"PackCost: coefficients must be finite, >= 0 and not all 0: {self}")

    @property
    def stages(self) -> int:
        return len(self.tile_ms)

    def totals(self) -> tuple[float, float, float]:
        """(ms per tile, per token, per squared token) summed over stages."""
        return sum(self.tile_ms), sum(self.token_ms), sum(self.attention_ms)

    def sample_ms(self, vit: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Each sample's share of a pack's modeled time, summed over stages."""
        a, b, c = self.totals()
        t = np.asarray(tokens, np.float64)
        return a * np.asarray(vit, np.float64) + b * t + c * t * t

    def stage_ms(self, tiles: np.ndarray, tokens: np.ndarray, sumsq: np.ndarray) -> np.ndarray:
        """(stages, ...) modeled time per stage of packs with these totals."""
        f = [np.asarray(x, np.float64) for x in (tiles, tokens, sumsq)]
        return np.stack([a * f[0] + b * f[1] + c * f[2] for a, b, c in
                         zip(self.tile_ms, self.token_ms, self.attention_ms, strict=True)])

    @classmethod
    def parse(cls, text: str) -> PackCost:
        """'A,B,C' (ms per tile, per token, per squared token) -> a one-stage PackCost."""
        parts = text.split(",")
        if len(parts) != 3:
            raise ValueError(f"cost '{text}': expected three numbers 'A,B,C'")
        try:
            a, b, c = (float(p) for p in parts)
        except ValueError as exc:
            raise ValueError(f"cost '{text}': {exc}") from exc
        return cls(tile_ms=(a,), token_ms=(b,), attention_ms=(c,))

    def to_dict(self) -> dict:
        return {k: list(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, doc: dict, where: str = "cost") -> PackCost:
        try:
            return cls(tile_ms=tuple(doc["tile_ms"]), token_ms=tuple(doc["token_ms"]),
                       attention_ms=tuple(doc["attention_ms"]))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}: expected tile_ms, token_ms and attention_ms lists "
                             f"({exc})") from exc


DEFAULT_COST = PackCost(tile_ms=(0.0,), token_ms=(1.0,), attention_ms=(1.0 / (6 * 2048),))
"""Modeled time without a model: the LLM cost of a 2048-wide model, tokens + sum(len^2) / (6 x
2048) (Megatron's per-layer FLOPs in units of a token; attention in a pack is block-diagonal)."""


@dataclass(frozen=True, kw_only=True)
class Level:
    """One packing level of hierarchical balance packing: its budgets, the micro-batches per
    rank of a step drawn from it, and the layers each pipeline stage recomputes at this level
    (one count per stage, from the planner; empty: the run's own setting)."""

    vit_budget: int
    token_budget: int
    micro_batches: int
    vit_recompute: tuple[int, ...] = ()
    llm_recompute: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_int("Level", "vit_budget", self.vit_budget, 0)
        _check_int("Level", "token_budget", self.token_budget, 1)
        _check_int("Level", "micro_batches", self.micro_batches, 1)
        for name in ("vit_recompute", "llm_recompute"):
            counts = tuple(int(x) for x in getattr(self, name))
            if any(x < 0 for x in counts):
                raise ValueError(f"Level: {name} counts must be >= 0, got {counts}")
            object.__setattr__(self, name, counts)
        if self.vit_recompute and self.llm_recompute and \
                len(self.vit_recompute) != len(self.llm_recompute):
            raise ValueError("Level: vit_recompute and llm_recompute need one count per stage "
                             f"each ({len(self.vit_recompute)} vs {len(self.llm_recompute)})")

    def fits(self, vit: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        return (np.asarray(vit) <= self.vit_budget) & (np.asarray(tokens) <= self.token_budget)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, doc: dict) -> Level:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in doc.items()})

    @classmethod
    def parse(cls, text: str, micro_batches: int | None = None) -> Level:
        """'V/T' or 'V/TxM' (tiles / tokens, x micro-batches per rank per step)."""
        body, _, m = text.partition("x")
        v, sep, t = body.partition("/")
        try:
            if not sep:
                raise ValueError("missing '/'")
            micro = int(m) if m else micro_batches
            if micro is None:
                raise ValueError("micro-batches not given ('V/TxM')")
            return cls(vit_budget=int(v), token_budget=int(t), micro_batches=micro)
        except ValueError as exc:
            raise ValueError(f"level '{text}': expected TILES/TOKENS[xMICRO] ({exc})") from exc


@dataclass(frozen=True, kw_only=True)
class BalanceConfig:
    """How to balance one epoch.

    - dp_size, micro_batches: data-parallel ranks and packs per rank per step.
    - vit_budget, token_budget: the most tiles and tokens a pack may hold (hard limits).
    - mode: 'random' (each step's mix as random as a shuffle) or 'grouped' (similar packs share
      a step). algorithm: 'default' (slot balancing) or 'isf' (OmniBal's ISF, isf_rounds rounds,
      a pack with isf_threshold tokens is full; default token_budget - 128).
    - oversize: a sample over a budget is an 'error', a pack of its own ('solo') or 'skip'ped.
    - cost: the modeled time of a pack (PackCost; None: DEFAULT_COST), balanced beside tokens.
    - tail_tolerance: packs over the mean tokens or modeled time by more than this share (and,
      while what packs lack in tiles, tokens or time costs more than this share, the lightest
      packs) form steps of their own, among equals, so that they do not set the pace of the
      others (random mode; grouped mode sorts every step by tiles and time).
    - levels: hierarchical balance packing (empty: one level at the budgets). Levels ascend;
      the last one is the budgets and micro_batches above. curriculum_steps: that many steps of
      the first (shortest) level open the epoch.
    - seed: every epoch e of a run uses seed + e.
    """

    dp_size: int
    micro_batches: int = 1
    vit_budget: int
    token_budget: int
    seed: int = 0
    mode: str = "random"
    algorithm: str = "default"
    oversize: str = "error"
    cost: PackCost | None = None
    tail_tolerance: float = 0.015
    isf_rounds: int = 10
    isf_threshold: int | None = None
    levels: tuple[Level, ...] = field(default=())
    curriculum_steps: int = 0

    def __post_init__(self) -> None:
        where = "BalanceConfig"
        _check_int(where, "dp_size", self.dp_size, 1)
        _check_int(where, "micro_batches", self.micro_batches, 1)
        _check_int(where, "vit_budget", self.vit_budget, 0)
        _check_int(where, "token_budget", self.token_budget, 1)
        _check_int(where, "seed", self.seed, 0)
        _check_int(where, "isf_rounds", self.isf_rounds, 1)
        _check_int(where, "curriculum_steps", self.curriculum_steps, 0)
        if self.isf_threshold is not None:
            _check_int(where, "isf_threshold", self.isf_threshold, 0)
        _check_choice(where, "mode", self.mode, MODES)
        _check_choice(where, "algorithm", self.algorithm, ALGORITHMS)
        _check_choice(where, "oversize", self.oversize, OVERSIZE)
        if not 0.0 <= float(self.tail_tolerance) <= 1.0:
            raise ValueError(f"{where}: tail_tolerance must lie in [0, 1], got "
                             f"{self.tail_tolerance!r}")
        if self.cost is not None and not isinstance(self.cost, PackCost):
            raise ValueError(f"{where}: cost must be a PackCost, got {type(self.cost).__name__}")
        levels = tuple(self.levels)
        object.__setattr__(self, "levels", levels)
        if not levels:
            if self.curriculum_steps:
                raise ValueError(f"{where}: curriculum_steps needs levels")
            return
        for a, b in zip(levels, levels[1:], strict=False):
            if not (a.token_budget < b.token_budget and a.vit_budget <= b.vit_budget):
                raise ValueError(f"{where}: levels must ascend (tokens strictly, tiles not "
                                 f"descending): {a.vit_budget}/{a.token_budget} then "
                                 f"{b.vit_budget}/{b.token_budget}")
        top = levels[-1]
        if (top.vit_budget, top.token_budget, top.micro_batches) != \
                (self.vit_budget, self.token_budget, self.micro_batches):
            raise ValueError(f"{where}: the last level ({top.vit_budget}/{top.token_budget} x"
                             f"{top.micro_batches}) must be the budgets and micro-batches "
                             f"({self.vit_budget}/{self.token_budget} x{self.micro_batches})")
        stages = {len(x) for lv in levels for x in (lv.vit_recompute, lv.llm_recompute) if x}
        if len(stages) > 1:
            raise ValueError(f"{where}: levels give recompute for different stage counts "
                             f"{sorted(stages)}")

    @property
    def threshold(self) -> int:
        """ISF's full-pack token count."""
        if self.isf_threshold is None:
            return self.token_budget - ISF_THRESHOLD_MARGIN
        return self.isf_threshold

    @property
    def all_levels(self) -> tuple[Level, ...]:
        """The levels, or the one level of the budgets."""
        return self.levels or (Level(vit_budget=self.vit_budget, token_budget=self.token_budget,
                                     micro_batches=self.micro_batches),)

    def with_seed(self, seed: int) -> BalanceConfig:
        return replace(self, seed=seed)

    def to_dict(self) -> dict:
        """JSON-able (the plan file's meta)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["cost"] = None if self.cost is None else self.cost.to_dict()
        out["levels"] = [lv.to_dict() for lv in self.levels]
        return out

    @classmethod
    def from_dict(cls, doc: dict) -> BalanceConfig:
        doc = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        if doc.get("cost") is not None:
            doc["cost"] = PackCost.from_dict(doc["cost"])
        doc["levels"] = tuple(Level.from_dict(lv) for lv in doc.get("levels") or ())
        return cls(**doc)
