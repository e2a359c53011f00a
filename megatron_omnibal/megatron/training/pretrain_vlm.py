"""Entry point on megatron.training.pretrain for balanced VLM training.

`python -m megatron_omnibal.pretrain_vlm <Megatron flags> --omnibal ...` (and the patched
Megatron-LM pretrain_vlm.py, which calls `main()`): Megatron's own flags drive training
(optimizer, schedule, checkpoints, logging, parallel sizes); the --omnibal* flags choose the model
dimensions (a plan's model_spec or --omnibal-model), the stage layout and per-stage recompute
(plan or flags) and the balanced data. Everything is validated before Megatron creates a process
group. On a CPU-only torch it runs through enable_cpu_megatron() with gloo; on GPUs unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from megatron_omnibal.megatron.checkpoint.checkpoint_check import (
    RUN_INFO,
    ResumePlan,
    check_resume,
    run_info,
)
from megatron_omnibal.megatron.flags.args import (
    OmnibalArgsError,
    OmnibalSettings,
    add_omnibal_args,
    load_plan,
    validate_omnibal_args,
)
from megatron_omnibal.megatron.flags.optimizer_args import check_optimizer_args
from megatron_omnibal.megatron.flags.run_args import complete_argv
from megatron_omnibal.megatron.runtime.compat import ensure_typing_override
from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron
from megatron_omnibal.megatron.runtime.notes import note_fallbacks, quiet_fallback_warnings
from megatron_omnibal.megatron.runtime.stderr import write_line
from megatron_omnibal.megatron.stages.finetune import install_vit_lr_override
from megatron_omnibal.megatron.stages.layout import (
    embedding_ranks,
    megatron_layout_flag,
    rank_stages,
)
from megatron_omnibal.megatron.training.lora_checkpoints import install_lora_checkpoints

RANK0_GRACE_S = 5.0  # how long other ranks let rank 0 print an error they all found
ForwardStep = Callable[[Any, Any], Any]
IteratorsBuilder = Callable[..., tuple[Any, Any, Any]]


def main(
    argv: Sequence[str] | None = None,
    forward_step_func: ForwardStep | None = None,
    build_iterators: IteratorsBuilder | None = None,
) -> int:
    """Parse Megatron's and the --omnibal* flags, validate them, train. Returns the exit status.

    `forward_step_func` replaces the package's forward step (tests wrap it to record losses);
    `build_iterators(settings, spec)` the balanced data stream (the benchmark's baseline
    batching), with the signature of build_data_iterators.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_fallback_warnings()
    cpu = enable_cpu_megatron()
    _skip_runtime_helper_build()
    if "-h" in argv or "--help" in argv:
        return _help()
    ensure_typing_override()  # megatron.training on Python 3.11, on GPUs too
    if cpu and not any(a.split("=")[0] == "--distributed-backend" for a in argv):
        argv += ["--distributed-backend", "gloo"]
    if "--data-parallel-random-init" not in argv:
        # DP ranks draw different micro-batch shapes, so their dropout RNG streams diverge;
        # Megatron checkpoints (and restores) each DP rank's RNG state only with this flag,
        # otherwise every rank resumes with DP rank 0's. Parameters start equal either way
        # (it broadcasts them from DP rank 0).
        argv.append("--data-parallel-random-init")
    try:
        argv, settings, spec, resume, source = prepare(argv)
    except (OmnibalArgsError, ValueError) as exc:
        return _fail(exc)
    note_fallbacks()
    from megatron.training.arguments import parse_and_validate_args

    sys.argv = [sys.argv[0], *argv]  # Megatron's parser reads sys.argv
    args = parse_and_validate_args(
        extra_args_provider=add_omnibal_args, args_defaults=megatron_defaults(spec)
    )
    # Saved with Megatron's args in every checkpoint: the export reads the model and layout.
    args.omnibal_model_spec = json.dumps(spec.to_dict())
    args.omnibal_stages = json.dumps([st.to_dict() for st in settings.layouts])
    if settings.lora is not None:  # the export merges or writes the adapters from this
        args.omnibal_lora = json.dumps(settings.lora.to_dict())
        args.omnibal_lora_save = settings.lora_save
    from megatron_omnibal.megatron.stream.loader import SampleLoadError

    try:
        train(args, settings, spec, resume, forward_step_func, build_iterators, source)
    except SampleLoadError as exc:  # a sample that cannot be loaded (--omnibal-bad-sample)
        return _fail(exc, every_rank=True)
    return 0



def run_entry() -> int:
    """`python -m megatron_omnibal.pretrain_vlm`: main, then this rank's process group ended
    before the interpreter's teardown (see runtime/shutdown.py)."""
    from megatron_omnibal.megatron.runtime.shutdown import end_process_group

    status = main()
    end_process_group()
    return status

def prepare(argv: list[str]) -> tuple[list[str], OmnibalSettings, Any, ResumePlan, Any]:
    """Every check of the run, on Megatron's parse of the completed command line, before
    Megatron validates (and prints) its arguments or creates a process group: the command line
    completed from the plan and model, with the pipeline layout Megatron is to build, the run's
    settings, model spec and resume plan, and the opened data source (None: synthetic data).
    Raises OmnibalArgsError (or ValueError) naming what is wrong."""
    from megatron.training.arguments import add_megatron_arguments

    pre = _preparse(argv)
    plan = load_plan(pre.omnibal_plan) if pre.omnibal_plan else None
    spec = resolve_spec(pre, plan)
    parser = _raising(
        add_omnibal_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    )
    source = (
        f"--omnibal-plan {pre.omnibal_plan}" if plan is not None
        else f"--omnibal-model {pre.omnibal_model}"
    )  # fmt: skip
    world = int(os.environ.get("WORLD_SIZE", "1"))
    argv = complete_argv(argv, parser, spec, plan, source, world)
    args = _parsed(parser, argv, spec, world)
    if plan is not None and not args.use_distributed_optimizer and args.rank == 0:
        write_line(
            "pretrain_vlm: note: the plan's memory figures assume --use-distributed-optimizer "
            "(Adam state sharded over DP), an optimizer setting this run does not give"
        )
    check_model_args(args, spec)
    check_optimizer_args(args)
    settings = validate_omnibal_args(
        args, plan, vit_layers=spec.vit.num_layers, tokens_per_tile=spec.tokens_per_tile
    )
    if settings.lora is not None:
        _check_lora(settings, spec, args)
    source = None
    if settings.data != "synthetic":
        from megatron_omnibal.megatron.stream.dataset import open_source

        # configuration, count and a spread of samples (from their text: no image opened);
        # the ranks that decode images switch pixels on when they build their iterator
        from megatron_omnibal.megatron.stream.node_plans import shared_local_rank

        source = open_source(  # on every local rank: its record index made once per node
            settings.source, settings.lengths, spec, pixels=False, by_epoch=settings.by_epoch,
            local_rank=shared_local_rank(),
        )
    resume = check_resume(settings, spec.vit.num_attention_heads)
    if len(settings.layouts) > 1:  # Megatron builds, numbers and counts the layers as laid out
        argv += ["--pipeline-model-parallel-layout", megatron_layout_flag(settings.layouts)]
    return argv, settings, spec, resume, source


def _check_lora(settings: OmnibalSettings, spec: Any, args: argparse.Namespace) -> None:
    """LoRA's targets and rank against the model, its parts against --omnibal-freeze, and
    the local layer specs it is built on."""
    from megatron_omnibal.megatron.flags.lora_args import check_lora_model
    from megatron_omnibal.models.lora import LoraError

    try:
        check_lora_model(settings.lora, spec, settings.finetune.freeze)
    except LoraError as exc:
        raise OmnibalArgsError(str(exc)) from exc
    from megatron_omnibal.megatron.stages.layer_specs import HAVE_TE

    if HAVE_TE and getattr(args, "transformer_impl", "transformer_engine") != "local":
        raise OmnibalArgsError(
            "--omnibal-lora-rank: LoRA adapters are built on megatron-core's local linear "
            "layers; add --transformer-impl local"
        )


def _parsed(
    parser: argparse.ArgumentParser, argv: list[str], spec: Any, world: int
) -> argparse.Namespace:
    """Megatron's parse of `argv` with the few values its validation would derive (rank, data
    parallel size, default global batch, the model's defaults), checked like it checks them."""
    args = parser.parse_args(argv)
    for key, value in megatron_defaults(spec).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.rank, args.world_size = int(os.environ.get("RANK", "0")), world
    model = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    if world % model:
        raise OmnibalArgsError(
            f"{world} processes do not divide into model replicas of TP "
            f"{args.tensor_model_parallel_size} x PP {args.pipeline_model_parallel_size} x CP "
            f"{args.context_parallel_size}"
        )
    args.data_parallel_size = world // model
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    return args


def _help() -> int:
    """The --omnibal* flags. Megatron's own --help cannot print in megatron-core 0.19.2 (the help
    of --moe-paged-stash-buffer-size-factor-cuda holds a stray '%'), so only ours are listed."""
    parser = add_omnibal_args(
        argparse.ArgumentParser(
            prog="python -m megatron_omnibal.pretrain_vlm",
            usage="%(prog)s [Megatron-LM training flags] --omnibal [--omnibal-* flags]",
            description=__doc__.split("\n\n")[1],
        )
    )
    parser.print_help()
    return 0


def _fail(exc: Exception, every_rank: bool = False) -> int:
    """Print the error and return 2. An error every rank finds alike (a flag, a file) is
    printed once, by rank 0; the other ranks wait a moment before they exit, since torchrun
    stops the remaining ranks as soon as one exits, and rank 0 must get to print."""
    if every_rank or int(os.environ.get("RANK", "0")) == 0:
        write_line(f"pretrain_vlm: error: {exc}")
    else:
        time.sleep(RANK0_GRACE_S)
    return 2


def _raising(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser with its errors (an unknown flag, a bad value) raised as OmnibalArgsError,
    so that they are printed once like the others, not as a usage text per rank."""

    def error(message: str) -> None:
        raise OmnibalArgsError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def _preparse(argv: list[str]) -> argparse.Namespace:
    """The --omnibal* flags alone, to learn the model before Megatron's parser needs its size."""
    parser = _raising(
        add_omnibal_args(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    )
    pre, _ = parser.parse_known_args(argv)
    if not pre.omnibal:
        raise OmnibalArgsError("this entry point trains with --omnibal; pass --omnibal")
    return pre


def resolve_spec(pre: argparse.Namespace, plan: Any = None) -> Any:
    """The ModelSpec: --omnibal-model (a preset, a model_spec file or an HF checkpoint
    directory), else the plan's model_spec; both given must agree."""
    from megatron_omnibal.models.resolve import resolve_model

    from_plan = None if plan is None else plan.model_spec
    if pre.omnibal_model is None:
        if from_plan is None:
            raise OmnibalArgsError(
                "no model: give --omnibal-model NAME|FILE|HF_DIR or --omnibal-plan"
            )
        return from_plan
    name = pre.omnibal_model
    try:
        spec = resolve_model(name)
    except ValueError as exc:
        raise OmnibalArgsError(f"--omnibal-model {name}: {exc}") from exc
    if from_plan is not None and from_plan != spec:
        raise OmnibalArgsError(
            f"--omnibal-model {name} differs from the model_spec of --omnibal-plan "
            f"{pre.omnibal_plan}; the plan was made for another model"
        )
    return spec


def megatron_defaults(spec: Any) -> dict[str, Any]:
    """Megatron arguments an --omnibal run takes unless given (the model's shape flags are
    completed on the command line: run_args)."""
    return {
        "max_position_embeddings": spec.llm.max_position_embeddings,
        "seq_length": spec.llm.max_position_embeddings,
        "tokenizer_type": "NullTokenizer",
        "dataloader_type": "external",
        "eval_interval": 1000,
    }


def check_model_args(args: argparse.Namespace, spec: Any) -> None:
    """Megatron flags an --omnibal run replaces (data loader, recompute, layout, sample
    counts) must be absent or say what it does."""
    if args.dataloader_type != "external":
        raise OmnibalArgsError(
            f"--dataloader-type {args.dataloader_type}: --omnibal brings its own iterator "
            "(external)"
        )
    # Per-stage recompute is full recompute of a block of layers (the plan's flags say so too);
    # anything else would be silently ignored, so it is refused.
    if args.recompute_granularity not in (None, "full") or args.recompute_method not in (
        None,
        "block",
    ):
        raise OmnibalArgsError(
            f"--recompute-granularity {args.recompute_granularity} --recompute-method "
            f"{args.recompute_method}: with --omnibal each stage recomputes whole layers "
            "(full, block) as --omnibal-vit-recompute / --omnibal-llm-recompute or the plan say"
        )
    if args.recompute_num_layers is not None:
        raise OmnibalArgsError(
            "--recompute-num-layers: with --omnibal the counts are per stage "
            "(--omnibal-vit-recompute / --omnibal-llm-recompute or the plan)"
        )
    # The balanced stream has a constant number of micro-batches per step and a varying number
    # of samples per step: Megatron's sample-based schedules would count packs.
    if getattr(args, "train_samples", None):
        raise OmnibalArgsError(
            "--train-samples: with --omnibal a step trains a varying number of samples "
            "(balanced packs); give --train-iters (the start-up summary prints the steps per "
            "epoch and samples per step)"
        )
    if getattr(args, "rampup_batch_size", None):
        raise OmnibalArgsError(
            "--rampup-batch-size: with --omnibal the micro-batches per step belong to the "
            "balanced plan and stay constant"
        )


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """TransformerConfig fields every tower takes from Megatron's flags."""
    return {
        "params_dtype": args.params_dtype,
        "pipeline_dtype": args.params_dtype,
        "bf16": args.bf16,
        "fp16": args.fp16,
        "hidden_dropout": args.hidden_dropout,
        "attention_dropout": args.attention_dropout,
        "init_method_std": args.init_method_std,
        "use_cpu_initialization": args.use_cpu_initialization,
        "deallocate_pipeline_outputs": True,
        "sequence_parallel": args.sequence_parallel,  # the LLM's (megatron.configs)
        # The interleaved schedule's point-to-point mode, as megatron.training derives it
        # (batched sends with two chunks per rank swap tensors on PP=2).
        "overlap_p2p_comm": args.overlap_p2p_comm,
        "batch_p2p_comm": not args.overlap_p2p_comm,
    }


def train(
    args: argparse.Namespace,
    settings: OmnibalSettings,
    spec: Any,
    resume: ResumePlan,
    forward_step_func: ForwardStep | None = None,
    build_iterators: IteratorsBuilder | None = None,
    source: Any = None,
) -> None:
    """megatron.training.pretrain with the VLM stage provider and the balanced iterator.

    `args` is Megatron's validated namespace (this entry point hands it to megatron.training
    only); `resume` (from check_resume) says where the data stream starts; `source` is the
    data source prepare opened (None: synthetic). With the package's own iterator, rank 0
    prints the start-up summary and every logged iteration gets the balance figures
    (training_log.py); a replaced `build_iterators` has no balanced plan to report.
    """
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_omnibal.megatron.stages.step import forward_step

    _run_steps_of_their_levels()
    args.calculate_per_token_loss = True  # losses are token sums; Megatron divides globally
    install_vit_lr_override(settings.finetune.vit_lr_mult)
    install_lora_checkpoints(settings)
    args.variable_seq_lengths = True  # balanced micro-batches differ in shape
    args.eval_iters = 0  # the balanced stream is for training; there is no validation split
    # Megatron saves its argument namespace in every checkpoint: the next resume checks this.
    setattr(args, RUN_INFO, run_info(settings, resume.identity, resume.origin))
    cfg = pretrain_cfg_container_from_args(args)
    if build_iterators is None:
        plans = node_plans(settings, resume)
        _install_iteration_log(settings, resume, spec, plans)
        data_provider = partial(build_data_iterators, settings, spec, origin=resume.origin,
                                plans=plans, source=source,
                                chunks=chunk_streams(settings))  # fmt: skip
    else:
        data_provider = partial(build_iterators, settings, spec)
    # Every rank builds its own iterator: no broadcast from TP rank 0 (training.py reads this).
    data_provider.is_distributed = True  # type: ignore[attr-defined]
    pretrain(
        cfg,
        data_provider,
        ModelType.encoder_or_decoder,
        forward_step_func or forward_step,
        model_provider=partial(_model_provider, settings, spec, config_overrides(args), []),
        # A tied output head's gradient is summed with the embedding's between their stages.
        get_embedding_ranks=embedding_ranks(settings.layouts, settings.pp_size),
        get_position_embedding_ranks=_first_rank,
    )


def node_plans(settings: OmnibalSettings, resume: ResumePlan) -> Any:
    """The run's epoch plans, balanced once per node (node_plans.NodePlans; the local rank
    from torchrun's LOCAL_RANK)."""
    from megatron_omnibal.megatron.stream.node_plans import NodePlans

    return NodePlans(
        settings.by_epoch,
        settings.balance,
        resume.identity.to_dict(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def _install_iteration_log(
    settings: OmnibalSettings, resume: ResumePlan, spec: Any, plans: Any
) -> None:
    """The start-up summary and notes (rank 0) and the per-iteration log (installed into
    Megatron's training_log on every rank: every rank counts consumed samples)."""
    from megatron.training import get_args

    from megatron_omnibal.megatron.stream.stream_steps import StreamSteps
    from megatron_omnibal.megatron.training import training_log
    from megatron_omnibal.megatron.training.throughput import device_name, run_throughput

    if plans is not None:  # the per-step sums made with the node's plans
        steps = StreamSteps(plans, settings.by_epoch, resume.origin, plans.steps)
    else:
        sampler = balanced_sampler(settings, 0, plans)
        steps = StreamSteps(sampler.plan, sampler.lengths_of, resume.origin)
    throughput = run_throughput(
        spec, settings.world_size, settings.precision, settings.peak_tflops, device_name()
    )
    predicted_step_ms = settings.plan.predicted.step_ms if settings.plan else None
    if settings.rank == 0:
        for note in resume.notes:
            print(f"pretrain_vlm: note: {note}", flush=True)
        identity = resume.identity
        summary = training_log.startup_summary(
            layouts=settings.layouts,
            tp=settings.tp_size,
            dp=settings.dp_size,
            micro_batches=settings.micro_batches,
            vit_budget=settings.balance.vit_budget,
            token_budget=settings.balance.token_budget,
            num_samples=identity.num_samples,
            lengths_file=settings.lengths_path,
            source=settings.data,
            balancer=(
                f"balancer {settings.balance.algorithm}, mode {settings.balance.mode}, "
                f"seed {settings.balance.seed}"
            ),
            steps=steps,
            start_iteration=resume.start_iteration,
            throughput=throughput,
            predicted_step_ms=predicted_step_ms,
        )
        print("\n".join(summary), flush=True)
    log = training_log.IterationLog(
        steps=steps,
        log_interval=settings.log_interval,
        tensorboard_interval=settings.tensorboard_log_interval,
        is_logger=settings.rank == settings.world_size - 1,
        throughput=throughput,
        predicted_step_ms=predicted_step_ms,
    )

    def set_consumed(samples: int) -> None:  # Megatron's count, in its namespace
        get_args().consumed_train_samples = samples

    training_log.install(log, set_consumed)


def _run_steps_of_their_levels() -> None:
    """megatron.training runs each step for its run-wide get_num_microbatches(); a step of a
    packing level runs that level's count instead (step.per_step_micro_batches; the count of
    a one-level run is the run's own). Megatron's learning-rate schedule keeps counting
    --global-batch-size per step; its consumed samples are set from the plan (training_log)."""
    import megatron.training.training as loop

    from megatron_omnibal.megatron.stages.step import per_step_micro_batches

    if getattr(loop.get_forward_backward_func, "__omnibal__", False):
        return
    get = loop.get_forward_backward_func

    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
        return per_step_micro_batches(get(*args, **kwargs))

    get_forward_backward_func.__omnibal__ = True  # type: ignore[attr-defined]
    loop.get_forward_backward_func = get_forward_backward_func


def _first_rank(pp_ranks: list[int], *_: Any) -> list[int]:
    return list(pp_ranks[:1])


def _model_provider(
    settings: OmnibalSettings,
    spec: Any,
    overrides: dict[str, Any],
    built: list[Any],
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    pg_collection: Any = None,
    **_: Any,
) -> Any:
    """This rank's stage, or its model chunk `vp_stage` (appended to `built`: with a tied
    output head the rank's chunks are tied once the last is built, tied_head.py)."""
    from megatron_omnibal.megatron.stages.provider import vlm_model_provider
    from megatron_omnibal.megatron.stages.tied_head import tie_chunks

    chunk = vlm_model_provider(
        spec,
        list(settings.layouts),
        pre_process,
        post_process,
        vp_stage,
        config_overrides=overrides,
        pg_collection=pg_collection,
        finetune=settings.finetune,
        level_recompute=settings.level_recompute,
        lora=settings.lora,
        seed=settings.seed,
    )
    if vp_stage is not None:
        built.append(chunk)
        if vp_stage == settings.vpp - 1 and spec.llm.tie_embeddings:
            tie_chunks(built)
    return chunk


def balanced_sampler(settings: OmnibalSettings, dp_rank: int, plans: Any = None) -> Any:
    """The balanced sampler of one DP rank (its `plan(epoch)` is every rank's plan), with each
    epoch's lengths: a length file with videos draws their frames per epoch from the balance
    seed (data/video_lengths.py), the same on every rank and at every resume. `plans`: the
    epoch plans (node_plans; None: balanced in this process)."""
    from megatron_omnibal.balance.sampler import BalancedBatchSampler

    return BalancedBatchSampler(
        settings.lengths, settings.balance, dp_rank=dp_rank, lengths_of_epoch=settings.by_epoch,
        plan_of_epoch=plans,
    )  # fmt: skip


def build_data_iterators(
    settings: OmnibalSettings,
    spec: Any,
    _num_samples: Any = None,
    *,
    origin: Any = None,
    plans: Any = None,
    source: Any = None,
    chunks: Any = None,
    vp_stage: int | None = None,
) -> tuple[Any, None, None]:
    """(train iterator, no validation, no test) for this rank, at Megatron's iteration of the
    stream that starts at `origin` (data_identity.StreamOrigin; None: iteration 0, epoch 0).
    `plans`: the run's epoch plans (node_plans; None: balanced in this process); `source`: the
    data source prepare opened (None: opened here for a real dataset). With model chunks
    (interleaved 1F1B) megatron.training asks once per chunk (`vp_stage`): chunk 0's call
    builds the stream, the others read it through `chunks` (chunk_streams.SharedStream).

    Only ranks whose stage holds the patch embedding decode pixels; the others get token ids,
    labels and shape-only tiles. Micro-batches come from Megatron's --num-workers processes on
    the ranks that decode pixels; the others build them in the training process (they only
    tokenize: a worker's hand-over costs them more than the work, and each worker process
    holds a few hundred MB).
    """
    import atexit

    from megatron.core import parallel_state
    from megatron.training import get_args

    if vp_stage:
        return chunks.view(vp_stage), None, None
    ranks = StageRanks(
        dp=parallel_state.get_data_parallel_rank(),
        pp=parallel_state.get_pipeline_model_parallel_rank(),
        tp=parallel_state.get_tensor_model_parallel_rank(),
        model_size=parallel_state.get_pipeline_model_parallel_world_size()
        * parallel_state.get_tensor_model_parallel_world_size(),
    )
    # Megatron's iteration once it loaded its checkpoint: where this rank's stream resumes
    iterator, policy = data_iterator(
        settings, spec, ranks, get_args().iteration, origin=origin, plans=plans, source=source
    )
    atexit.register(_report_skipped, policy)
    return (iterator if chunks is None else chunks.attach(iterator)), None, None


def chunk_streams(settings: OmnibalSettings) -> Any:
    """The stream shared by a rank's model chunks (None with one chunk per rank)."""
    from megatron_omnibal.megatron.stream.chunk_streams import SharedStream

    return SharedStream(settings.vpp) if settings.vpp > 1 else None


@dataclass(frozen=True)
class StageRanks:
    """This rank's place in the model-parallel grid, as the data stream needs it."""

    dp: int
    pp: int
    tp: int
    model_size: int  # PP x TP: the ranks that read one replica's stream


def data_iterator(
    settings: OmnibalSettings,
    spec: Any,
    ranks: StageRanks,
    start_step: int,
    *,
    origin: Any = None,
    plans: Any = None,
    source: Any = None,
) -> tuple[Any, Any]:
    """(this rank's balanced iterator from Megatron iteration `start_step`, its bad-sample
    policy): build_data_iterators once the process groups say where the rank stands."""
    import torch

    from megatron_omnibal.megatron.stream.batch import SyntheticSamples
    from megatron_omnibal.megatron.stream.data import BalancedDataIterator
    from megatron_omnibal.megatron.stream.loader import MicroBatchDataset

    by_epoch = settings.by_epoch
    sampler = balanced_sampler(settings, ranks.dp, plans)
    pixels = any(
        settings.layouts[v].patch_embed
        for v in rank_stages(len(settings.layouts), settings.pp_size, ranks.pp)
    )
    if settings.data == "synthetic":
        make_sample = SyntheticSamples(by_epoch, spec, seed=settings.seed, pixels=pixels)
        describe = str
    else:
        if source is None:
            from megatron_omnibal.megatron.stream.dataset import open_source

            source = open_source(
                settings.source, settings.lengths, spec, pixels=pixels, check=0, by_epoch=by_epoch
            )
        source.pixels = pixels
        make_sample = source
        describe = make_sample.describe
    workers = settings.num_workers if pixels else 0
    if workers:
        # The worker processes are the parallelism; a forked tokenizer's thread pool is not.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    most = max(lv.micro_batches for lv in settings.balance.all_levels)  # per step
    policy = bad_sample_policy(settings, ranks, pixels, describe, most)
    iterator = BalancedDataIterator(
        sampler,
        settings.micro_batches,
        MicroBatchDataset(make_sample, partial(filler_sample, spec)),
        start_step=start_step,
        num_workers=workers,
        pin_memory=torch.cuda.is_available(),
        policy=policy,
        origin=origin,
    )
    return iterator, policy


def bad_sample_policy(
    settings: OmnibalSettings, ranks: StageRanks, pixels: bool, describe: Any,
    micro_batches: int,
) -> Any:
    """The skip/error policy of this rank; under skip, the decoding rank of each replica (first
    stage, TP rank 0) tells the other ranks through the job's store which samples failed."""
    from megatron_omnibal.megatron.stream.loader import (
        BadSampleChannel,
        BadSamplePolicy,
        report_path,
    )

    decides = pixels and ranks.tp == 0
    channel = None
    if settings.bad_sample == "skip" and ranks.model_size > 1:
        import torch.distributed as dist

        # the decision of micro-batch k is read before step k/M + 2 ends: keep three steps
        channel = BadSampleChannel(
            dist.distributed_c10d._get_default_store(), ranks.dp, 3 * micro_batches
        )
    report = None
    if decides:
        report = report_path(
            settings.bad_sample_report, settings.save, settings.dp_size, ranks.dp
        )
    return BadSamplePolicy(
        mode=settings.bad_sample,
        decides=decides,
        channel=channel,
        report=report,
        describe=describe,
    )  # fmt: skip


def _report_skipped(policy: Any) -> None:
    summary = policy.summary()
    if summary:
        write_line(summary)


def filler_sample(spec: Any) -> Any:
    """A sample that trains nothing: a BOS token without loss, one dummy (image_flags 0) tile,
    like InternVL's text-only samples (native-resolution models: no image). It stands in for an
    empty balanced pack."""
    import torch

    from megatron_omnibal.megatron.stream.batch import IGNORE_INDEX, Sample

    size = spec.vit.image_size
    if spec.vit.native_resolution:  # no image at all (a native tower has no dummy tiles)
        return Sample(
            tokens=torch.zeros(1, dtype=torch.int64),
            labels=torch.full((1,), IGNORE_INDEX, dtype=torch.int64),
            images=torch.zeros(0, spec.vit.patch_dim),
            image_flags=torch.zeros(0, dtype=torch.int64),
            image_grid=torch.zeros(0, 3, dtype=torch.int64),
        )
    return Sample(
        tokens=torch.zeros(1, dtype=torch.int64),
        labels=torch.full((1,), IGNORE_INDEX, dtype=torch.int64),
        images=torch.zeros(1, 3, size, size),
        image_flags=torch.zeros(1, dtype=torch.int64),
    )


def _skip_runtime_helper_build() -> None:
    # megatron/training/initialize.py _compile_dependencies() runs `make` in
    # megatron/core/datasets (core/datasets/utils.py compile_helpers). The megatron-core wheel
    # ships that extension prebuilt (helpers_cpp) but no Makefile, so `make` fails and the run
    # exits, on GPUs as on CPUs. Skip the build when the built module imports (a Megatron-LM
    # checkout with its Makefile keeps building as before). This run uses no Megatron dataset.
    from megatron.core.datasets import utils

    if getattr(utils.compile_helpers, "__omnibal__", False):
        return
    orig = utils.compile_helpers

    def compile_helpers() -> None:
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            orig()

    compile_helpers.__omnibal__ = True  # type: ignore[attr-defined]
    utils.compile_helpers = compile_helpers
