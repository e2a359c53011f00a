"""plan.json as one type: `Plan`, read, written and validated here and nowhere else.

The planner writes it; `omnibal simulate`, the Megatron side (stage layout, recompute, data
budgets, model spec) and the checkpoint converter read it. Every part is a frozen dataclass that
checks itself when built, so a plan made in code and a plan read from a file obey the same
rules; `load_plan` names the file and the field of anything wrong.

Layer ranges are half-open in each tower's global numbering (an empty range is [x, x]);
`vit_recompute` / `llm_recompute` are the first k ViT / LLM layers of a stage recomputed in
full. Every time, bubble and speedup under `predicted` is modeled, never measured.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_omnibal.balance.config import Level, PackCost
from megatron_omnibal.models.spec import ModelSpec, SpecError
from megatron_omnibal.planner.cost_model.config_files import hardware_from_dict
from megatron_omnibal.planner.cost_model.hardware import Hardware
from megatron_omnibal.planner.plan_file.plan_fields import PlanError, from_json, need, to_json
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout

PLAN_VERSION = 2
MODES = ("exact", "bmp", "megatron")
COST_MODELS = ("analytic", "measured profile")
MEMORY_SLACK_GIB = 1e-3  # peaks are stored rounded to 3 decimals
_SHA256 = re.compile(r"[0-9a-f]{64}")

__all__ = [
    "PLAN_VERSION",
    "BaselinePlan",
    "DataPlan",
    "LevelPrediction",
    "ParallelSizes",
    "Plan",
    "PlanError",
    "Prediction",
    "SameParallelBaseline",
    "StagePlan",
    "load_plan",
    "save_plan",
]


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        need(
            isinstance(value, int) and not isinstance(value, bool) and value >= 1,
            f"{name} must be a positive integer, got {value!r}",
        )


def _non_negative(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        need(
            isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
            f"{name} must be a non-negative number, got {value!r}",
        )


@dataclass(frozen=True, kw_only=True)
class ParallelSizes:
    """tp x pp x dp = gpus; `micro_batches` per replica and step; `vpp` model chunks per rank
    (1: 1F1B; more: Megatron's interleaved 1F1B, micro-batches divisible by pp); `ep` expert
    parallel ranks of a mixture-of-experts LLM, carved out of the dp ranks (a plan written
    before expert parallelism reads as 1)."""

    tp: int
    pp: int
    dp: int
    vpp: int = 1
    micro_batches: int
    gpus: int
    ep: int = 1

    def __post_init__(self) -> None:
        _positive(self, "tp", "pp", "dp", "vpp", "micro_batches", "gpus", "ep")
        need(self.dp % self.ep == 0, f"ep {self.ep} does not divide dp {self.dp}: expert-parallel "
             "groups are carved out of the data-parallel ranks")  # fmt: skip
        need(
            self.vpp == 1 or (self.pp >= 2 and self.micro_batches % self.pp == 0),
            f"vpp {self.vpp} (interleaved 1F1B) needs pp >= 2 and micro_batches divisible by "
            f"pp, got pp={self.pp}, micro_batches={self.micro_batches}",
        )
        need(
            self.tp * self.pp * self.dp == self.gpus,
            f"tp x pp x dp = {self.tp * self.pp * self.dp} != gpus {self.gpus}",
        )


@dataclass(frozen=True, kw_only=True)
class StagePlan(StageLayout):
    """One pipeline stage: its layout (the slice of [patch embed, ViT, projector + LLM embed,
    LLM, head] the training stage builds) and what the plan predicts for it.

    With vpp > 1 a virtual stage: `stage` v is model chunk v // pp of pipeline rank v % pp, and
    `peak_memory_gib` is that rank's peak (all its chunks)."""

    stage: int
    forward_ms: float  # per micro-batch, at the mean balanced micro-batch
    backward_ms: float  # recompute included
    peak_memory_gib: float  # at the largest micro-batch

    def __post_init__(self) -> None:
        for key in ("vit_layers", "llm_layers"):
            first, end = getattr(self, key)
            need(0 <= first <= end, f"{key} {[first, end]} is not a [first, end) range")
        for key, layers in (
            ("vit_recompute", self.num_vit_layers),
            ("llm_recompute", self.num_llm_layers),
        ):
            value = getattr(self, key)
            need(
                0 <= value <= layers,
                f"{key} {value}: recompute counts must be within the stage's {layers} layers",
            )
        need(self.projector == self.llm_embed, "llm_embed must sit with the projector")
        _non_negative(self, "forward_ms", "backward_ms", "peak_memory_gib")


@dataclass(frozen=True, kw_only=True)
class DataPlan:
    """Budgets of the balanced micro-batches, and which samples the plan was made from.

    `lengths_sha256` digests the lengths by content (provenance.lengths_sha256); the path is
    None for a plan made from in-memory lengths.
    """

    vit_budget: int
    token_budget: int
    global_batch_samples: int
    seed: int
    num_samples: int
    lengths_path: str | None
    lengths_sha256: str
    # The balancer's modeled time of a pack (per stage) and the packing levels (hierarchical
    # balance packing; empty: one level at the budgets), each with its per-stage recompute.
    pack_cost: PackCost | None = None
    levels: tuple[Level, ...] = ()

    def __post_init__(self) -> None:
        _positive(self, "vit_budget", "token_budget", "global_batch_samples", "num_samples")
        need(self.seed >= 0, f"seed must be >= 0, got {self.seed}")
        need(
            bool(_SHA256.fullmatch(self.lengths_sha256)),
            f"lengths_sha256 must be 64 lowercase hex digits, got {self.lengths_sha256!r}",
        )


@dataclass(frozen=True, kw_only=True)
class BaselinePlan:
    """The fastest configuration a Megatron-LM user could choose by hand that fits memory.

    Same model, GPUs and global batch; vision encoder + projector on the first stage (Megatron's
    LLaVA layout); LLM layers per stage as Megatron's flags allow (even, or uneven first/last
    stage); `micro_batch_size` samples per micro-batch, each padded to the longest of its
    micro-batch; `--recompute-vision` (every ViT layer) and `--recompute-num-layers` (block
    method: the first k LLM layers of every stage, or of every model chunk); `vpp` model
    chunks per rank (1: 1F1B; more: interleaved 1F1B, each rank's LLM layers split evenly over
    its chunks). `peak_memory_gib`: one per rank.
    """

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    micro_batches: int
    llm_layers_per_stage: tuple[int, ...]
    recompute_vision: bool
    recompute_num_layers: int
    step_ms: float
    bubble_fraction: float
    peak_memory_gib: tuple[float, ...]
    configurations_searched: int
    configurations_fitting: int
    megatron_flags: tuple[str, ...]
    vpp: int = 1
    ep: int = 1  # --expert-model-parallel-size (a mixture-of-experts LLM)

    def __post_init__(self) -> None:
        _positive(self, "tp", "pp", "dp", "micro_batch_size", "micro_batches", "vpp", "ep")
        need(self.dp % self.ep == 0, f"ep {self.ep} does not divide dp {self.dp}")
        need(
            self.vpp == 1
            or (
                self.pp >= 2
                and self.micro_batches % self.pp == 0
                and all(n % self.vpp == 0 for n in self.llm_layers_per_stage)
            ),
            f"vpp {self.vpp}: Megatron's interleaved 1F1B needs pp >= 2, micro_batches "
            "divisible by pp and every stage's LLM layers divisible by vpp",
        )
        need(
            len(self.llm_layers_per_stage) == self.pp == len(self.peak_memory_gib),
            f"llm_layers_per_stage and peak_memory_gib need pp={self.pp} entries",
        )
        need(
            min(self.llm_layers_per_stage) >= 1,
            "llm_layers_per_stage: Megatron puts at least one LLM layer on every stage",
        )
        need(self.recompute_num_layers >= 0, "recompute_num_layers must be >= 0")
        _non_negative(self, "step_ms", "bubble_fraction")
        need(
            1 <= self.configurations_fitting <= self.configurations_searched,
            "configurations_fitting must be between 1 and configurations_searched",
        )


@dataclass(frozen=True, kw_only=True)
class SameParallelBaseline:
    """Megatron's layout at the plan's own tp/pp/dp/micro-batches (a detail, not the headline):
    ViT on stage 0, LLM split evenly, every layer recomputed, fixed-size padded batches."""

    step_ms: float
    bubble_fraction: float
    fits_memory: bool
    unit_ranges: tuple[tuple[int, int], ...]  # [first, end) over [ViT layers, projector, LLM]
    speedup: float


@dataclass(frozen=True, kw_only=True)
class LevelPrediction:
    """One packing level (data.levels, same order), modeled: a step of packs at 95% of its
    budgets with its recompute, the samples it holds (those no shorter level fits) and its
    estimated steps per epoch, and each stage's peak memory at its largest pack."""

    step_ms: float
    samples: int
    steps: int
    peak_memory_gib: tuple[float, ...]

    def __post_init__(self) -> None:
        _non_negative(self, "step_ms", "samples", "steps")


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Modeled step of the plan; `speedup` is against `baseline` (None when nothing fits).

    With `--levels`: `levels` per packing level, and the estimated epoch with the levels and
    with the budgets alone (`epoch_s`, `single_level_epoch_s`; set even when no level paid and
    the plan kept one).
    """

    step_ms: float
    bubble_fraction: float
    sync_ms: float
    speedup: float | None
    baseline: BaselinePlan | None
    same_parallel: SameParallelBaseline
    partition_mode: str
    cost_model: str
    profile_path: str | None = None
    profile_sha256: str | None = None
    levels: tuple[LevelPrediction, ...] = ()
    epoch_s: float | None = None
    single_level_epoch_s: float | None = None
    modeled: bool = True

    def __post_init__(self) -> None:
        _non_negative(self, "step_ms", "bubble_fraction", "sync_ms")
        need(
            (self.epoch_s is None) == (self.single_level_epoch_s is None),
            "epoch_s and single_level_epoch_s are recorded together",
        )
        need(self.partition_mode in MODES, f"partition_mode {self.partition_mode!r} not in {MODES}")
        need(self.cost_model in COST_MODELS, f"cost_model {self.cost_model!r} not in {COST_MODELS}")
        need(self.modeled, "modeled must be true: every figure here is a model prediction")
        need(
            (self.cost_model == "measured profile") == (self.profile_sha256 is not None),
            "profile_sha256 is recorded exactly when the cost model is a measured profile",
        )
        need(
            self.profile_sha256 is None or bool(_SHA256.fullmatch(self.profile_sha256)),
            f"profile_sha256 must be 64 lowercase hex digits, got {self.profile_sha256!r}",
        )
        if self.baseline is None:
            need(self.speedup is None, "speedup without a baseline that fits memory")
        else:
            want = self.baseline.step_ms / self.step_ms if self.step_ms > 0 else math.inf
            need(
                self.speedup is not None and math.isclose(self.speedup, want, rel_tol=1e-3),
                f"speedup {self.speedup} is not baseline.step_ms / step_ms = {want:.3f}",
            )


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything `omnibal plan` decided and predicted for one model, GPU type and GPU count."""

    version: int = PLAN_VERSION
    model_spec: ModelSpec
    hardware_spec: Hardware
    parallel: ParallelSizes
    stages: tuple[StagePlan, ...]
    data: DataPlan
    predicted: Prediction
    megatron_flags: tuple[str, ...]

    def __post_init__(self) -> None:
        need(
            self.version == PLAN_VERSION,
            f"version {self.version!r}: this omnibal reads plan version {PLAN_VERSION}; re-plan",
        )
        pp, stages = len(self.stages), self.stages
        par = self.parallel
        need(
            pp == par.pp * par.vpp,
            f"stages: {pp} stages for parallel.pp={par.pp} x vpp={par.vpp} (one per virtual "
            "stage)",
        )
        nv, nl = self.model_spec.vit.num_layers, self.model_spec.llm.num_layers
        experts = self.model_spec.llm.num_experts
        for key, ep in (("parallel.ep", par.ep),
                        ("predicted.baseline.ep", getattr(self.predicted.baseline, "ep", 1))):
            need(ep == 1 or (experts and experts % ep == 0),
                 f"{key} {ep}: expert parallelism needs a mixture-of-experts LLM whose "
                 f"experts ({experts}) it divides")  # fmt: skip
        vit_at = llm_at = 0
        for s, st in enumerate(stages):
            at = f"stages[{s}]"
            need(st.stage == s, f"{at}.stage is {st.stage}; stages must be listed in order")
            for key, start, total in (("vit_layers", vit_at, nv), ("llm_layers", llm_at, nl)):
                first, end = getattr(st, key)
                need(
                    first == start and end <= total,
                    f"{at}.{key} {[first, end]} does not continue at layer {start} within "
                    f"[0, {total}]",
                )
            need(st.patch_embed == (s == 0), f"{at}.patch_embed must be true on stage 0 only")
            need(st.head == (s == pp - 1), f"{at}.head must be true on the last stage only")
            if st.projector:
                need(
                    st.vit_layers[1] == nv and st.llm_layers[0] == 0,
                    f"{at}: the projector must follow the last ViT layer and precede LLM layer 0",
                )
            elif st.num_llm_layers:
                need(
                    any(x.projector for x in stages[:s]),
                    f"{at}: LLM layers before the projector",
                )
            need(
                st.num_vit_layers + st.num_llm_layers > 0 or st.projector,
                f"{at} holds no layers",
            )
            vit_at, llm_at = st.vit_layers[1], st.llm_layers[1]
        need(
            vit_at == nv and llm_at == nl,
            f"stages cover {vit_at}/{nv} ViT and {llm_at}/{nl} LLM layers",
        )
        need(sum(st.projector for st in stages) == 1, "exactly one stage holds the projector")
        budget = self.memory_budget_gib + MEMORY_SLACK_GIB
        for s, st in enumerate(stages):
            need(
                st.peak_memory_gib <= budget,
                f"stages[{s}].peak_memory_gib {st.peak_memory_gib} exceeds the "
                f"{self.memory_budget_gib:.3f} GiB budget of {self.hardware_spec.name}",
            )
        base = self.predicted.baseline
        if base is not None:
            need(
                max(base.peak_memory_gib) <= budget,
                "predicted.baseline: a configuration over the memory budget is no baseline",
            )
            need(
                base.tp * base.pp * base.dp == self.parallel.gpus,
                "predicted.baseline: tp x pp x dp must use the plan's GPUs",
            )
            need(
                sum(base.llm_layers_per_stage) == nl,
                f"predicted.baseline.llm_layers_per_stage must add up to the {nl} LLM layers",
            )
            need(
                base.micro_batch_size * base.micro_batches * base.dp
                == self.data.global_batch_samples,
                "predicted.baseline: micro_batch_size x micro_batches x dp must be the global "
                "batch",
            )
        self._check_levels(budget)
        ranges = self.predicted.same_parallel.unit_ranges
        need(
            len(ranges) == par.pp and ranges[0][0] == 0 and ranges[-1][1] == nv + 1 + nl,
            f"predicted.same_parallel.unit_ranges must cover the {nv + 1 + nl} units in "
            f"{par.pp} stages",
        )

    def _check_levels(self, budget_gib: float) -> None:
        """Levels end at the budgets and micro-batches, recompute within each stage's layers,
        every level within the memory budget, one prediction per level; pack cost per stage."""
        data, pp = self.data, len(self.stages)
        cost = data.pack_cost
        need(cost is None or cost.stages == pp, f"data.pack_cost needs {pp} stages")
        levels = data.levels
        need(
            not levels or self.parallel.vpp == 1,
            "data.levels: packing levels are planned for 1F1B only (parallel.vpp 1)",
        )
        need(
            len(self.predicted.levels) == len(levels),
            f"predicted.levels: {len(self.predicted.levels)} entries for {len(levels)} levels",
        )
        if not levels:
            return
        top = levels[-1]
        need(
            (top.vit_budget, top.token_budget, top.micro_batches)
            == (data.vit_budget, data.token_budget, self.parallel.micro_batches),
            "data.levels: the last level must be the budgets and parallel.micro_batches",
        )
        for i, (a, b) in enumerate(zip(levels, levels[1:], strict=False)):
            need(
                a.token_budget < b.token_budget and a.vit_budget <= b.vit_budget,
                f"data.levels[{i + 1}]: levels must ascend (tokens strictly, tiles not "
                "descending)",
            )
        for i, (lv, pred) in enumerate(zip(levels, self.predicted.levels, strict=True)):
            at = f"data.levels[{i}]"
            need(
                len(lv.vit_recompute) == pp == len(lv.llm_recompute),
                f"{at}: vit_recompute and llm_recompute need pp={pp} counts",
            )
            for s, st in enumerate(self.stages):
                need(
                    lv.vit_recompute[s] <= st.num_vit_layers
                    and lv.llm_recompute[s] <= st.num_llm_layers,
                    f"{at}: stage {s} recomputes more layers than it holds",
                )
            need(
                len(pred.peak_memory_gib) == pp and max(pred.peak_memory_gib) <= budget_gib,
                f"predicted.levels[{i}].peak_memory_gib {list(pred.peak_memory_gib)} exceeds "
                f"the {self.memory_budget_gib:.3f} GiB budget (or is not one per stage)",
            )

    @property
    def memory_budget_gib(self) -> float:
        return self.hardware_spec.memory_gib - self.hardware_spec.reserve_gib

    def to_dict(self) -> dict:
        return to_json(self)

    @classmethod
    def from_dict(cls, doc: object, where: str = "plan") -> Plan:
        """A plan from its JSON form; any error names `where` and the field."""
        need(isinstance(doc, dict), f"{where}: expected a JSON object")
        version = doc.get("version")
        need(
            version == PLAN_VERSION,
            f"{where}: version {version!r}: this omnibal reads plan version {PLAN_VERSION}; "
            "re-plan",
        )
        built = {}
        try:
            if "model_spec" in doc:
                built["model_spec"] = ModelSpec.from_dict(doc["model_spec"], "model_spec")
            if "hardware_spec" in doc:
                built["hardware_spec"] = hardware_from_dict(doc["hardware_spec"], "hardware_spec")
        except (SpecError, ValueError) as exc:
            raise PlanError(f"{where}: {exc}") from None
        return from_json(cls, doc, where, built)


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write plan.json (checked by reading it back: a plan we cannot load is never written)."""
    text = json.dumps(plan.to_dict(), indent=1) + "\n"
    if Plan.from_dict(json.loads(text), str(path)) != plan:
        raise PlanError(f"{path}: the plan does not survive its JSON round trip")
    Path(path).write_text(text)


def load_plan(path: str | Path, where: str | None = None) -> Plan:
    """Read and validate plan.json; errors name `where` (default: the path) and the field."""
    where = where or str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise PlanError(f"{where}: no such plan file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"{where}: not a JSON plan ({exc})") from None
    return Plan.from_dict(doc, where)
