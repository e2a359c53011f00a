"""What a plan is asked for: model, GPUs, data, fixed sizes, search mode; checked once, up front.

The planner, the baseline search and `omnibal simulate` all take one `PlanRequest` instead of a
dozen loose parameters, and an impossible request (a TP that does not divide the heads, more
stages than layers, GPUs that are not a multiple of TP x PP) stops here with a message naming
the `omnibal plan` flag, before any search runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_omnibal.balance.config import Level
from megatron_omnibal.data.lengths import LengthStats
from megatron_omnibal.models.lora import LoraError, LoraSpec, lora_layers
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.cost_model.hardware import Hardware
from megatron_omnibal.planner.plan_file.plan import MODES
from megatron_omnibal.planner.search.parallel_sizes import heads_divisible, partition_units


@dataclass(frozen=True, kw_only=True, eq=False)
class PlanRequest:
    """`tp` / `pp` / `vpp` / `micro_batches` None: searched (`vpp` > 1: interleaved 1F1B with
    vpp chunks per rank; 1, the default: plain 1F1B, the schedule pretrain_vlm builds).
    `profile`: a measured layer profile (from `omnibal profile`, TP 1) replacing the FLOPs
    model; `lengths_path` / `profile_path` are recorded in the plan (None: in-memory data).
    `levels`: packing levels (hierarchical balance packing): 'auto' (the planner chooses),
    'V/T[xM],..' (levels below the plan's budgets, which form the last level), None (one
    level)."""

    model: ModelSpec
    hardware: Hardware
    lengths: LengthStats
    lengths_path: str | None = None
    gpus: int
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = 1
    micro_batches: int | None = None
    global_batch: int = 1024
    mode: str = "exact"
    seed: int = 0
    profile: dict | None = None
    profile_path: str | None = None
    plan_path: str = "plan.json"
    levels: str | None = None
    lora: LoraSpec | None = None  # LoRA: frozen base weights, adapters trained (lora_costs.py)
    # expert parallel size of a mixture-of-experts LLM (None: searched; a dense LLM has 1)
    ep: int | None = None
    # the whole ViT and projector (DeepStack mergers included) on the first stage, as
    # Megatron-Bridge, ms-swift and MindSpeed-MM run a VLM: what the peers can do
    vit_on_first_stage: bool = False

    def __post_init__(self) -> None:
        for flag, value in (("--gpus", self.gpus), ("--global-batch", self.global_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise ValueError(f"--micro-batches must be >= 1, got {self.micro_batches}")
        if self.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {self.seed}")
        if self.mode not in MODES:
            raise ValueError(f"unknown partition mode '{self.mode}' (choose from {MODES})")
        if len(self.lengths) == 0:
            raise ValueError(f"{self.lengths_path or 'lengths'}: no samples")
        if self.levels not in (None, "auto"):
            for part in self.levels.split(","):
                try:
                    Level.parse(part.strip(), 1)
                except ValueError as exc:
                    raise ValueError(f"--levels: {exc} (or 'auto')") from None
        if self.profile is None and self.profile_path is not None:
            raise ValueError("profile_path without a profile")
        if self.lora is not None:
            if self.profile is not None:
                raise ValueError(
                    "--lora-rank with --profile: a measured profile prices full training; plan "
                    "LoRA with the FLOPs model"
                )
            try:
                lora_layers(self.model, self.lora, "--lora-targets", "--lora-rank")
            except LoraError as exc:
                raise ValueError(str(exc)) from exc
        if self.profile is not None and self.tp not in (None, 1):
            raise ValueError(
                f"--tp {self.tp}: a measured profile is for TP = 1 (one GPU per layer)"
            )
        self._check_parallel()

    def _check_parallel(self) -> None:
        model, tp, pp = self.model, self.tp, self.pp
        units = partition_units(model)
        if tp is not None and (tp < 1 or not heads_divisible(model, tp)):
            raise ValueError(
                f"--tp {tp}: must divide the attention heads (ViT "
                f"{model.vit.num_attention_heads}, LLM {model.llm.num_attention_heads}, "
                f"KV groups {model.llm.num_query_groups})"
            )
        if pp is not None and not 1 <= pp <= units:
            raise ValueError(
                f"--pp {pp}: must be between 1 and the {units} partition units of "
                f"{model.name} ({model.vit.num_layers} ViT layers, projector, "
                f"{model.llm.num_layers} LLM layers)"
            )
        vpp, shown = self.vpp, "auto" if self.vpp is None else self.vpp
        if vpp is not None and (vpp < 1 or (vpp > 1 and pp == 1) or (pp or 2) * vpp > units):
            raise ValueError(
                f"--vpp {shown}: virtual stages need pp >= 2 and pp x vpp at most the {units} "
                f"partition units of {model.name}"
            )
        if vpp != 1 and self.mode != "exact":
            raise ValueError(f"--vpp {shown}: virtual stages are searched in --mode exact only")
        if vpp != 1 and self.levels is not None:
            raise ValueError(f"--vpp {shown}: packing levels are planned for 1F1B only (vpp 1)")
        both = (tp or 1) * (pp or 1)
        if both > self.gpus or self.gpus % both:
            raise ValueError(f"--gpus {self.gpus} is not a multiple of tp x pp = {both}")
        if self.vit_on_first_stage and vpp != 1:
            raise ValueError(f"--vit-on-first-stage with --vpp {shown}: planned for 1F1B only")
        self._check_ep(both)

    def _check_ep(self, tp_pp: int) -> None:
        """--ep: a mixture-of-experts LLM's experts and the data-parallel ranks (megatron-core
        carves the EP groups out of DP) must both be divisible by it."""
        ep, llm = self.ep, self.model.llm
        if ep is None:
            return
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ValueError(f"--ep must be a positive integer, got {ep!r}")
        if ep == 1:
            return
        if not llm.is_moe:
            raise ValueError(
                f"--ep {ep}: {self.model.name} has a dense LLM (no experts to spread); expert "
                "parallelism needs a mixture-of-experts model"
            )
        if llm.num_experts % ep:
            raise ValueError(f"--ep {ep} does not divide the {llm.num_experts} experts of "
                             f"{self.model.name}")  # fmt: skip
        if self.profile is not None:
            raise ValueError(f"--ep {ep} with --profile: a measured profile prices one GPU's "
                             "layers; plan expert parallelism with the FLOPs model")  # fmt: skip
        fixed = self.tp is not None and self.pp is not None
        world = self.gpus // tp_pp if fixed else self.gpus
        if world % ep:
            what = f"data-parallel size {world} (gpus / (tp x pp))" if fixed else (
                f"--gpus {self.gpus}")
            raise ValueError(f"--ep {ep} does not divide the {what}: megatron-core carves the "
                             "expert-parallel groups out of the data-parallel ranks")  # fmt: skip

    @property
    def search_ep(self) -> int | None:
        """The EP to plan at (None: searched): a measured profile prices one GPU's layers, so
        1 with one."""
        return 1 if self.profile is not None else self.ep

    @property
    def search_tp(self) -> int | None:
        """The TP to plan at: a measured profile fixes it at 1 (it was timed on one GPU)."""
        return 1 if self.profile is not None else self.tp
