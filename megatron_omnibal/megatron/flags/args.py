"""The `--omnibal*` flags and their validation against Megatron's own arguments.

Everything here runs right after Megatron parses its arguments and BEFORE any process group
exists: a layout whose layers do not add up, a plan made for another pipeline size or a length
file that does not match the dataset must stop every rank with a message that says what is
wrong, not hang a 1000-GPU job in its first collective. Nothing here imports torch or Megatron.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, replace

from megatron_omnibal.balance.config import (
    ALGORITHMS,
    MODES,
    OVERSIZE,
    BalanceConfig,
    Level,
    PackCost,
)
from megatron_omnibal.cli_args import non_negative_int, pack_cost, positive_float, positive_int
from megatron_omnibal.data.lengths import LengthsError, LengthStats, load_lengths
from megatron_omnibal.data.video_lengths import EpochLengths, run_lengths
from megatron_omnibal.megatron.flags.lora_args import add_lora_args, lora_save, lora_settings
from megatron_omnibal.megatron.runtime.stderr import write_line
from megatron_omnibal.megatron.stages.finetune import FinetuneSettings, add_finetune_args
from megatron_omnibal.megatron.stages.layout import (
    LayoutError,
    StageLayout,
    layout_from_counts,
    layout_from_plan,
    level_recompute,
)
from megatron_omnibal.megatron.stream.data_identity import lengths_digest
from megatron_omnibal.megatron.stream.node_plans import (
    NodeLengths,
    node_lengths,
    shared_local_rank,
)
from megatron_omnibal.megatron.stream.source import SourceSettings
from megatron_omnibal.models.lora import LoraError, LoraSpec
from megatron_omnibal.planner.plan_file.plan import Plan, PlanError
from megatron_omnibal.planner.plan_file.plan import load_plan as read_plan
from megatron_omnibal.planner.plan_file.provenance import lengths_sha256

BAD_SAMPLE = ("error", "skip")
PRECISIONS = ("bf16", "fp16", "fp32")
# Megatron's own ways of splitting the layers; --omnibal sets the layout itself.
MEGATRON_LAYOUT_FLAGS = (
    ("--pipeline-model-parallel-layout", "pipeline_model_parallel_layout"),
    ("--decoder-first-pipeline-num-layers", "decoder_first_pipeline_num_layers"),
    ("--decoder-last-pipeline-num-layers", "decoder_last_pipeline_num_layers"),
    ("--account-for-embedding-in-pipeline-split", "account_for_embedding_in_pipeline_split"),
    ("--account-for-loss-in-pipeline-split", "account_for_loss_in_pipeline_split"),
    ("--num-layers-per-virtual-pipeline-stage", "num_layers_per_virtual_pipeline_stage"),
    ("--num-virtual-stages-per-pipeline-rank", "num_virtual_stages_per_pipeline_rank"),
)


class OmnibalArgsError(ValueError):
    """A bad --omnibal* flag or a combination Megatron cannot run; the message names the flag."""


@dataclass(frozen=True, kw_only=True)
class OmnibalSettings:
    """The validated configuration of one run (identical on every rank but `rank`): the
    --omnibal* flags and the Megatron arguments the package uses, built once at start-up
    (validate_omnibal_args). Everything below the entry points receives this (or a part of
    it), never Megatron's argument namespace."""

    layouts: tuple[StageLayout, ...]  # pp x vpp virtual stages in model order
    vpp: int = 1  # model chunks per pipeline rank (a plan's vpp: interleaved 1F1B)
    micro_batches: int
    dp_size: int
    tp_size: int
    world_size: int
    rank: int
    source: SourceSettings
    lengths: LengthStats  # as the model sees them (image tokens per tile, text scale)
    lengths_sha256: str  # their data_identity.lengths_digest, taken once per node
    plan: Plan | None
    balance: BalanceConfig  # seed: Megatron's --seed (epoch e balances with seed + e)
    by_epoch: EpochLengths  # each epoch's lengths (videos redraw their frames), read once
    finetune: FinetuneSettings
    lora: LoraSpec | None = None  # --omnibal-lora-*: adapters instead of full training
    lora_save: str = "full"  # adapters | full: what a LoRA run's checkpoints hold
    precision: str  # bf16 | fp16 | fp32, as Megatron's flags say
    peak_tflops: float | None  # --omnibal-peak-tflops
    vocab_size: int | None  # --vocab-size: the model's, before Megatron pads it
    load: str | None  # --load
    ckpt_step: int | None  # --ckpt-step
    save: str | None  # --save
    restart_stream: bool  # Megatron's --finetune: training (re)starts at iteration 0
    allow_data_change: bool  # --omnibal-allow-data-change
    bad_sample: str  # --omnibal-bad-sample
    bad_sample_report: str | None  # --omnibal-bad-sample-report
    num_workers: int  # Megatron's --num-workers (data loader processes of decoding ranks)
    log_interval: int
    tensorboard_log_interval: int

    def __post_init__(self) -> None:
        if not self.layouts:
            raise OmnibalArgsError("the pipeline layout has no stages")
        for flag, value in (
            ("--tensor-model-parallel-size", self.tp_size),
            ("the data-parallel size", self.dp_size),
            ("--global-batch-size / DP", self.micro_batches),
            ("the plan's vpp", self.vpp),
            ("--log-interval", self.log_interval),
            ("--tensorboard-log-interval", self.tensorboard_log_interval),
        ):
            if value < 1:
                raise OmnibalArgsError(f"{flag} must be >= 1, got {value}")
        if self.bad_sample not in BAD_SAMPLE:
            raise OmnibalArgsError(
                f"--omnibal-bad-sample {self.bad_sample}: choose from {', '.join(BAD_SAMPLE)}"
            )
        if self.precision not in PRECISIONS:
            raise OmnibalArgsError(f"precision {self.precision}: one of {', '.join(PRECISIONS)}")
        if self.num_workers < 0:
            raise OmnibalArgsError(f"--num-workers must be >= 0, got {self.num_workers}")
        if len(self.layouts) % self.vpp:
            raise OmnibalArgsError(
                f"{len(self.layouts)} stages do not make {self.vpp} chunks per pipeline rank"
            )

    @property
    def pp_size(self) -> int:
        return len(self.layouts) // self.vpp

    @property
    def data(self) -> str:
        return self.source.data

    @property
    def lengths_path(self) -> str:
        return self.source.lengths_path

    @property
    def seed(self) -> int:
        return self.balance.seed

    @property
    def level_recompute(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per stage, its (ViT, LLM) recompute in a step of each packing level (empty without
        levels: the layouts' counts throughout)."""
        if not self.balance.levels:
            return ()
        return level_recompute(self.layouts, self.balance.levels)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 30,15,0,0, got '{text}'"
        ) from exc
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"layer counts must be >= 0, got '{text}'")
    return values


def add_omnibal_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the --omnibal* flags (usable as megatron.training's `extra_args_provider`)."""
    g = parser.add_argument_group("omnibal", "balanced VLM training (megatron-omnibal)")
    g.add_argument(
        "--omnibal",
        action="store_true",
        help="train the VLM with balanced data, a planned split and planned recompute",
    )
    g.add_argument(
        "--omnibal-plan",
        metavar="PLAN.json",
        default=None,
        help="plan from `omnibal plan`: stage layout, recompute and data budgets; its parallel "
        "sizes, batch, precision, model shape and length file are filled in where not given",
    )
    g.add_argument(
        "--omnibal-lengths",
        metavar="FILE",
        default=None,
        help="per-sample length statistics of the training data (vit_num, token_num; "
        "default: the file the plan was made from)",
    )
    g.add_argument(
        "--omnibal-vit-pp-layers",
        type=_int_list,
        default=None,
        metavar="N,N,..",
        help="ViT layers per pipeline stage, e.g. 30,15,0,0 (instead of a plan)",
    )
    g.add_argument(
        "--omnibal-llm-pp-layers",
        type=_int_list,
        default=None,
        metavar="N,N,..",
        help="LLM layers per pipeline stage, e.g. 0,10,19,19 (instead of a plan)",
    )
    g.add_argument(
        "--omnibal-vit-recompute",
        type=_int_list,
        default=None,
        metavar="N,N,..",
        help="ViT layers to recompute per stage, at every packing level (default: the plan's, "
        "per level with levels, else none)",
    )
    g.add_argument(
        "--omnibal-llm-recompute",
        type=_int_list,
        default=None,
        metavar="N,N,..",
        help="LLM layers to recompute per stage, at every packing level (default: the plan's, "
        "per level with levels, else none)",
    )
    g.add_argument(
        "--omnibal-vit-budget",
        type=positive_int,
        default=None,
        help="image tiles per micro-batch the balancer aims at (default: the plan's)",
    )
    g.add_argument(
        "--omnibal-token-budget",
        type=positive_int,
        default=None,
        help="LLM tokens per micro-batch the balancer aims at (default: the plan's)",
    )
    g.add_argument(
        "--omnibal-mode",
        choices=MODES,
        default="random",
        help="random: shuffle samples each epoch; grouped: keep dataset groups together",
    )
    g.add_argument(
        "--omnibal-algorithm",
        choices=ALGORITHMS,
        default="default",
        help="balancer: fill-and-complete (default) or OmniBal's ISF",
    )
    g.add_argument(
        "--omnibal-oversize",
        choices=OVERSIZE,
        default="error",
        help="a sample above a budget: error, a micro-batch of its own, or skip it",
    )
    g.add_argument(
        "--omnibal-cost",
        type=pack_cost,
        default=None,
        metavar="A,B,C",
        help="modeled time of a pack, A*tiles + B*tokens + C*sum(len^2) (default: the plan's "
        "data.pack_cost); steps are formed to even it out across ranks",
    )
    g.add_argument(
        "--omnibal-levels",
        default=None,
        metavar="V/TxM,..",
        help="packing levels (tiles/tokens x micro-batches per rank), ascending, the last the "
        "budgets and --global-batch-size / DP micro-batches; each step runs its level's "
        "micro-batches (default: the plan's data.levels with their per-stage recompute, else "
        "one level)",
    )
    g.add_argument(
        "--omnibal-curriculum-steps",
        type=non_negative_int,
        default=0,
        help="with levels: this many steps of the shortest level open each epoch",
    )
    g.add_argument(
        "--omnibal-model",
        default=None,
        metavar="NAME|FILE",
        help="model dimensions: a preset (tiny, small, or a planner preset) or a "
        "model_spec JSON/YAML file (default: the plan's model_spec)",
    )
    g.add_argument(
        "--omnibal-precision",
        choices=PRECISIONS,
        default=None,
        help="training precision (default: Megatron's --bf16 / --fp16 where given, else the "
        "plan's, bf16; fp32 without a plan)",
    )
    g.add_argument(
        "--omnibal-data",
        default="synthetic",
        metavar="synthetic|PATH",
        help="sample source: 'synthetic' (deterministic random samples shaped like the "
        "lengths) or the dataset the length file was computed from (LLaVA JSON/JSONL, "
        "InternVL meta, or a Megatron-Energon folder or metadataset: its split and task "
        "encoder are the ones `omnibal stats` used)",
    )
    g.add_argument(
        "--omnibal-tokenizer",
        default=None,
        metavar="PATH",
        help="with --omnibal-data PATH: the tokenizer `omnibal stats` counted with, where it is "
        "now (default: the path stored in the length file; checked by fingerprint)",
    )
    g.add_argument(
        "--omnibal-bad-sample",
        choices=BAD_SAMPLE,
        default="error",
        help="a sample whose image cannot be loaded: stop naming it (default), or skip it on "
        "every rank of its replica, log it and list it in the report",
    )
    g.add_argument(
        "--omnibal-bad-sample-report",
        default=None,
        metavar="FILE.jsonl",
        help="report of skipped samples (default: omnibal_bad_samples.jsonl in --save, else in "
        "the working directory; .dpN per data-parallel replica when DP > 1)",
    )
    add_finetune_args(g)
    add_lora_args(g)
    g.add_argument(
        "--omnibal-allow-data-change",
        action="store_true",
        help="resume from a checkpoint trained on another data stream (other lengths, budgets, "
        "seed, DP size or balancer options): start a new epoch plan at the checkpoint's "
        "consumed samples instead of refusing",
    )
    g.add_argument(
        "--omnibal-text-scale",
        type=positive_int,
        default=1,
        help="synthetic data only: divide each sample's text tokens by this (a CPU dry run of "
        "long real lengths on a small model)",
    )
    g.add_argument(
        "--omnibal-peak-tflops",
        type=positive_float,
        default=None,
        metavar="TFLOPS",
        help="peak dense TFLOP/s of one GPU at the run's precision, for the MFU in the log "
        "(default: known A100/H100/H200 at BF16/FP16; otherwise MFU is n/a)",
    )
    return parser


def validate_omnibal_args(
    args: argparse.Namespace,
    plan: Plan | None,
    vit_layers: int | None = None,
    tokens_per_tile: int | None = None,
) -> OmnibalSettings:
    """Check the --omnibal* flags against Megatron's parsed (and validated) arguments.

    `plan` is --omnibal-plan as the caller loaded it (load_plan; None without the flag), so
    the file is read once per run. `vit_layers` is the model's ViT depth (None: whatever the
    layout covers); `tokens_per_tile` the model's image tokens per tile, to turn the length file
    into the lengths the model sees (None: keep them as they are). Call before
    megatron.training.pretrain: it creates no process group and raises OmnibalArgsError naming
    the offending flag.
    """
    if not getattr(args, "omnibal", False):
        raise OmnibalArgsError("--omnibal is not set")
    for flag, dest in MEGATRON_LAYOUT_FLAGS:
        if getattr(args, dest, None):
            raise OmnibalArgsError(
                f"{flag}: with --omnibal the pipeline layout comes from --omnibal-plan or "
                "--omnibal-vit-pp-layers / --omnibal-llm-pp-layers (any layer counts per stage)"
            )
    try:
        layouts = _layouts(args, plan, vit_layers)
    except LayoutError as exc:
        raise OmnibalArgsError(str(exc)) from exc
    if args.micro_batch_size != 1:
        raise OmnibalArgsError(
            f"--omnibal packs each micro-batch itself: use --micro-batch-size 1"
            f" (got {args.micro_batch_size})"
        )
    dp = args.data_parallel_size
    if args.global_batch_size % dp:
        raise OmnibalArgsError(
            f"--global-batch-size {args.global_batch_size} is not a multiple "
            f"of the data-parallel size {dp}"
        )
    micro = args.global_batch_size // dp
    vpp = len(layouts) // args.pipeline_model_parallel_size
    if plan is not None:
        _check_plan_sizes(plan, args, micro)
    if vpp > 1:
        _check_interleaved(args, micro, vpp)
    vit_budget, token_budget = _budgets(args, plan)
    lengths, lengths_sha256 = _node_lengths(args, plan, tokens_per_tile)
    balance = _balance_config(args, plan, dp, micro, vit_budget, token_budget)
    if vpp > 1:
        _check_interleaved_levels(args, balance.levels)
    try:  # each level's recompute must fit its stages: checked before any process group
        level_recompute(layouts, balance.levels)
    except LayoutError as exc:
        raise OmnibalArgsError(f"--omnibal-levels / the plan's data.levels: {exc}") from exc
    source = SourceSettings(
        data=args.omnibal_data,
        lengths_path=str(args.omnibal_lengths),
        tokenizer=args.omnibal_tokenizer,
        text_scale=args.omnibal_text_scale,
        trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
    )
    try:
        finetune = FinetuneSettings(
            freeze=frozenset(args.omnibal_freeze), vit_lr_mult=args.omnibal_vit_lr_mult
        )
    except ValueError as exc:
        raise OmnibalArgsError(str(exc)) from exc
    try:
        lora = lora_settings(args)
        saves = lora_save(args) if lora is not None else "full"
    except LoraError as exc:
        raise OmnibalArgsError(str(exc)) from exc
    return OmnibalSettings(
        layouts=tuple(layouts),
        vpp=vpp,
        micro_batches=micro,
        dp_size=dp,
        tp_size=args.tensor_model_parallel_size,
        world_size=int(getattr(args, "world_size", 1)),
        rank=int(getattr(args, "rank", 0)),
        source=source,
        lengths=lengths,
        lengths_sha256=lengths_sha256,
        plan=plan,
        balance=balance,
        by_epoch=run_lengths(args.omnibal_lengths, lengths, balance.seed),
        finetune=finetune,
        lora=lora,
        lora_save=saves,
        precision=run_precision(args),
        peak_tflops=args.omnibal_peak_tflops,
        vocab_size=getattr(args, "vocab_size", None),
        load=args.load,
        ckpt_step=getattr(args, "ckpt_step", None) or None,
        save=args.save,
        restart_stream=bool(getattr(args, "finetune", False)),
        allow_data_change=args.omnibal_allow_data_change,
        bad_sample=args.omnibal_bad_sample,
        bad_sample_report=args.omnibal_bad_sample_report,
        num_workers=args.num_workers,
        log_interval=args.log_interval,
        tensorboard_log_interval=args.tensorboard_log_interval,
    )


def run_precision(args: argparse.Namespace) -> str:
    """bf16, fp16 or fp32, as Megatron's flags say."""
    return "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) \
        else "fp32"


def load_plan(path: str) -> Plan:
    """plan.json, validated by the planner's Plan; errors name the flag, file and field."""
    try:
        return read_plan(path, where=f"--omnibal-plan {path}")
    except PlanError as exc:
        raise OmnibalArgsError(str(exc)) from exc


def _layouts(
    args: argparse.Namespace, plan: Plan | None, vit_total: int | None
) -> list[StageLayout]:
    """The stage layouts: from the two count flags, else from the plan (recompute flags win)."""
    pp, llm_total = args.pipeline_model_parallel_size, args.num_layers
    vit_rc, llm_rc = args.omnibal_vit_recompute, args.omnibal_llm_recompute
    if args.omnibal_vit_pp_layers is not None or args.omnibal_llm_pp_layers is not None:
        if args.omnibal_vit_pp_layers is None or args.omnibal_llm_pp_layers is None:
            raise OmnibalArgsError(
                "give both --omnibal-vit-pp-layers and --omnibal-llm-pp-layers"
                " (or neither, and --omnibal-plan)"
            )
        vit, llm = args.omnibal_vit_pp_layers, args.omnibal_llm_pp_layers
        if len(vit) != pp:
            raise OmnibalArgsError(
                f"--omnibal-vit-pp-layers {_fmt(vit)} has {len(vit)} stages, "
                f"--pipeline-model-parallel-size is {pp}"
            )
        layouts = layout_from_counts(vit, llm, vit_rc, llm_rc, vit_total, llm_total)
    elif plan is not None:
        for flag, counts in (
            ("--omnibal-vit-recompute", vit_rc),
            ("--omnibal-llm-recompute", llm_rc),
        ):
            if counts is not None and len(counts) != len(plan.stages):
                raise OmnibalArgsError(
                    f"{flag} {_fmt(counts)} has {len(counts)} stages, the plan "
                    f"{args.omnibal_plan} {len(plan.stages)} (pp {plan.parallel.pp} x vpp "
                    f"{plan.parallel.vpp})"
                )
        try:
            layouts = layout_from_plan(plan, pp, vit_total, llm_total, vit_rc, llm_rc)
        except LayoutError as exc:
            raise OmnibalArgsError(f"--omnibal-plan {args.omnibal_plan}: {exc}") from exc
    else:
        raise OmnibalArgsError(
            "--omnibal needs --omnibal-plan, or --omnibal-vit-pp-layers and --omnibal-llm-pp-layers"
        )
    return layouts


def _fmt(counts: tuple[int, ...]) -> str:
    return ",".join(str(c) for c in counts)


def _budgets(args: argparse.Namespace, plan: Plan | None) -> tuple[int, int]:
    vit, tok = args.omnibal_vit_budget, args.omnibal_token_budget
    if plan is not None:
        vit = plan.data.vit_budget if vit is None else vit
        tok = plan.data.token_budget if tok is None else tok
    for flag, value in (("--omnibal-vit-budget", vit), ("--omnibal-token-budget", tok)):
        if value is None:
            raise OmnibalArgsError(f"{flag} is needed (the plan gives none)")
        if int(value) <= 0:
            raise OmnibalArgsError(f"{flag} must be > 0, got {value}")
    return int(vit), int(tok)


def _check_plan_sizes(plan: Plan, args: argparse.Namespace, micro: int) -> None:
    """TP and PP must be the plan's (they shape every stage); another DP size or micro-batch
    count only changes the global batch (a dry run of a large plan on a few CPU processes), so
    rank 0 notes it."""
    where = f"--omnibal-plan {args.omnibal_plan}"
    par = plan.parallel
    for key, value in (
        ("tp", args.tensor_model_parallel_size),
        ("pp", args.pipeline_model_parallel_size),
    ):
        planned = getattr(par, key)
        if planned != value:
            raise OmnibalArgsError(
                f"{where} was made for {key}={planned}, this run has {key}={value}"
            )
    for key, value in (("dp", args.data_parallel_size), ("micro_batches", micro)):
        planned = getattr(par, key)
        if planned != value and getattr(args, "rank", 0) == 0:
            write_line(
                f"pretrain_vlm: note: {where} was made for {key}={planned}, this run has "
                f"{key}={value}"
            )


def _check_interleaved(args: argparse.Namespace, micro: int, vpp: int) -> None:
    """Megatron's condition for the interleaved schedule a plan with vpp > 1 runs, checked
    before any process group: micro-batches per step divisible by the pipeline size (its
    micro-batch groups)."""
    pp, where = args.pipeline_model_parallel_size, f"--omnibal-plan {args.omnibal_plan}"
    if micro % pp:
        raise OmnibalArgsError(
            f"{where} has vpp {vpp} (interleaved 1F1B): the micro-batches per step "
            f"(--global-batch-size {args.global_batch_size} / DP {args.data_parallel_size} = "
            f"{micro}) must be a multiple of --pipeline-model-parallel-size {pp}"
        )


def _check_interleaved_levels(args: argparse.Namespace, levels: tuple[Level, ...]) -> None:
    """Each packing level's micro-batches per step (a step runs its level's count) divisible
    by the pipeline size, as the interleaved schedule needs of every step."""
    pp = args.pipeline_model_parallel_size
    for lv in levels:
        if lv.micro_batches % pp:
            raise OmnibalArgsError(
                f"--omnibal-levels / the plan's data.levels with --omnibal-plan "
                f"{args.omnibal_plan} (interleaved 1F1B): level {lv.vit_budget}/"
                f"{lv.token_budget} x{lv.micro_batches} runs {lv.micro_batches} micro-batches "
                f"per step, not a multiple of --pipeline-model-parallel-size {pp}"
            )


def _node_lengths(
    args: argparse.Namespace, plan: Plan | None, tokens_per_tile: int | None
) -> NodeLengths:
    """_load_lengths and their digest once per node when torchrun starts several local ranks:
    local rank 0 reads, checks, converts and digests them, the others map its copy
    (node_plans.node_lengths)."""
    local_rank, path = shared_local_rank(), args.omnibal_lengths
    try:
        stat = os.stat(path) if path is not None and local_rank is not None else None
    except OSError:
        stat = None
    if stat is None:  # one rank, or no file (every rank reports it)
        lengths = _load_lengths(args, plan, tokens_per_tile)
        return NodeLengths(lengths, lengths_digest(lengths))
    key = {
        "path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "tokens_per_tile": tokens_per_tile, "text_scale": args.omnibal_text_scale,
        "plan_lengths": None if plan is None else plan.data.lengths_sha256,
    }  # fmt: skip
    return node_lengths(
        lambda: _load_lengths(args, plan, tokens_per_tile),
        key,
        local_rank=local_rank,
    )


def _load_lengths(
    args: argparse.Namespace, plan: Plan | None, tokens_per_tile: int | None
) -> LengthStats:
    if args.omnibal_lengths is None:
        raise OmnibalArgsError(
            "--omnibal needs --omnibal-lengths FILE (per-sample vit_num and token_num of the "
            "training data)"
        )
    try:
        lengths = load_lengths(args.omnibal_lengths)
    except LengthsError as exc:
        raise OmnibalArgsError(f"--omnibal-lengths: {exc}") from exc
    if plan is not None:
        where = f"--omnibal-plan {args.omnibal_plan}"
        if plan.data.num_samples != len(lengths):
            raise OmnibalArgsError(
                f"--omnibal-lengths {args.omnibal_lengths} has {len(lengths)} samples, but "
                f"{where} was made for a dataset of {plan.data.num_samples}"
            )
        if lengths_sha256(lengths) != plan.data.lengths_sha256:
            raise OmnibalArgsError(
                f"--omnibal-lengths {args.omnibal_lengths} holds other lengths than {where} was "
                f"made from ({plan.data.lengths_path}); re-plan on the training data's lengths"
            )
    if tokens_per_tile is None:
        return lengths
    from megatron_omnibal.data.lengths import read_stats_config
    from megatron_omnibal.data.sample.config import data_tokens_per_tile
    from megatron_omnibal.megatron.stream.data import model_lengths

    try:
        # The length file says how many image tokens per tile it counted; a plain length file
        # (no stored configuration) is taken as counted for this model.
        counted = data_tokens_per_tile(read_stats_config(args.omnibal_lengths))
        return model_lengths(
            lengths,
            tokens_per_tile if counted is None else counted,
            tokens_per_tile,
            args.omnibal_text_scale,
        )
    except (LengthsError, ValueError) as exc:
        raise OmnibalArgsError(f"--omnibal-lengths {args.omnibal_lengths}: {exc}") from exc


def _balance_config(
    args: argparse.Namespace,
    plan: Plan | None,
    dp: int,
    micro: int,
    vit_budget: int,
    token_budget: int,
) -> BalanceConfig:
    """The run's BalanceConfig from the flags, else the plan's `data` section."""
    try:
        if args.omnibal_cost is not None:
            cost = PackCost.parse(args.omnibal_cost)
        else:
            cost = plan.data.pack_cost if plan is not None else None
        if args.omnibal_levels is not None:
            levels = tuple(Level.parse(t, micro) for t in args.omnibal_levels.split(","))
        else:
            levels = _run_levels(plan.data.levels, micro) if plan is not None else ()
        # Recompute given by flags holds for every step: the levels' own counts give way.
        if args.omnibal_vit_recompute is not None:
            levels = tuple(replace(lv, vit_recompute=()) for lv in levels)
        if args.omnibal_llm_recompute is not None:
            levels = tuple(replace(lv, llm_recompute=()) for lv in levels)
        config = BalanceConfig(
            dp_size=dp,
            micro_batches=micro,
            vit_budget=vit_budget,
            token_budget=token_budget,
            seed=args.seed,
            mode=args.omnibal_mode,
            algorithm=args.omnibal_algorithm,
            oversize=args.omnibal_oversize,
            cost=cost,
            levels=levels,
            curriculum_steps=args.omnibal_curriculum_steps,
        )
    except (ValueError, TypeError) as exc:
        raise OmnibalArgsError(f"--omnibal balance settings: {exc}") from exc
    return config


def _run_levels(levels: tuple[Level, ...], micro: int) -> tuple[Level, ...]:
    """A plan's levels at this run's micro-batches per step (a dry run with another global
    batch): every level's count scaled alike, so that the levels keep their tokens per step
    in proportion; the last level runs exactly `micro`."""
    if not levels or levels[-1].micro_batches == micro:
        return levels
    top = levels[-1].micro_batches
    return tuple(replace(lv, micro_batches=max(1, round(lv.micro_batches * micro / top)))
                 for lv in levels)
