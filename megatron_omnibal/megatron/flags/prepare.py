"""The run's start-up checks: Megatron's command line completed and parsed, the --omnibal*
flags validated into OmnibalSettings, the model resolved and the data source opened.

Why before Megatron: megatron.training validates (and prints) its arguments and creates the
process groups; a bad flag, a plan made for another model or a missing file must stop every
rank first, with one message naming the flag, not a usage text per rank or a hang.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from megatron_omnibal.megatron.flags.args import (
    OmnibalArgsError,
    OmnibalSettings,
    add_omnibal_args,
    load_plan,
    validate_omnibal_args,
)
from megatron_omnibal.megatron.flags.moe_args import check_moe_args
from megatron_omnibal.megatron.flags.optimizer_args import check_optimizer_args
from megatron_omnibal.megatron.flags.run_args import complete_argv
from megatron_omnibal.megatron.runtime.stderr import write_line
from megatron_omnibal.megatron.stages.layout import megatron_layout_flag


def with_run_defaults(argv: list[str], cpu: bool) -> list[str]:
    """Megatron flags every --omnibal run takes unless given: gloo on a CPU-only torch, and
    per-DP-rank RNG states in checkpoints."""
    argv = list(argv)
    if cpu and not any(a.split("=")[0] == "--distributed-backend" for a in argv):
        argv += ["--distributed-backend", "gloo"]
    if "--data-parallel-random-init" not in argv:
        # DP ranks draw different micro-batch shapes, so their dropout RNG streams diverge;
        # Megatron checkpoints (and restores) each DP rank's RNG state only with this flag,
        # otherwise every rank resumes with DP rank 0's. Parameters start equal either way
        # (it broadcasts them from DP rank 0).
        argv.append("--data-parallel-random-init")
    return argv


def prepare_run(argv: list[str]) -> tuple[list[str], OmnibalSettings, Any, Any]:
    """Every check of the run's flags, on Megatron's parse of the completed command line: the
    command line completed from the plan and model, with the pipeline layout Megatron is to
    build, the run's settings and model spec, and the opened data source (None: synthetic
    data). Raises OmnibalArgsError (or ValueError) naming what is wrong."""
    from megatron.training.arguments import add_megatron_arguments

    pre = _preparse(argv)
    plan = load_plan(pre.omnibal_plan) if pre.omnibal_plan else None
    spec = resolve_spec(pre, plan)
    parser = raising(
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
    check_moe_args(args, spec, world)
    check_optimizer_args(args)
    settings = validate_omnibal_args(
        args, plan, vit_layers=spec.vit.num_layers, tokens_per_tile=spec.tokens_per_tile
    )
    if settings.lora is not None:
        _check_lora(settings, spec, args)
    if len(settings.layouts) > 1:  # Megatron builds, numbers and counts the layers as laid out
        argv += ["--pipeline-model-parallel-layout", megatron_layout_flag(settings.layouts)]
    return argv, settings, spec, _open_source(settings, spec)


def store_run_args(args: argparse.Namespace, settings: OmnibalSettings, spec: Any) -> None:
    """The model, the layout and LoRA as JSON in Megatron's validated namespace, which every
    checkpoint saves: the export reads them back."""
    args.omnibal_model_spec = json.dumps(spec.to_dict())
    args.omnibal_stages = json.dumps([st.to_dict() for st in settings.layouts])
    if settings.lora is not None:  # the export merges or writes the adapters from this
        args.omnibal_lora = json.dumps(settings.lora.to_dict())
        args.omnibal_lora_save = settings.lora_save


def _open_source(settings: OmnibalSettings, spec: Any) -> Any:
    """The dataset's configuration, count and a spread of samples (from their text: no image
    opened), on every local rank with its record index made once per node; the ranks that
    decode images switch pixels on when they build their iterator. None: synthetic data."""
    if settings.data == "synthetic":
        return None
    from megatron_omnibal.megatron.stream.dataset import open_source
    from megatron_omnibal.megatron.stream.node_plans import shared_local_rank

    return open_source(
        settings.source, settings.lengths, spec, pixels=False, by_epoch=settings.by_epoch,
        local_rank=shared_local_rank(),
    )  # fmt: skip


def _check_lora(settings: OmnibalSettings, spec: Any, args: argparse.Namespace) -> None:
    """LoRA's targets and rank against the model, its parts against --omnibal-freeze, and
    the local layer specs it is built on."""
    from megatron_omnibal.models.lora import LoraError, check_frozen, lora_layers

    lora, frozen = settings.lora, settings.finetune.freeze
    try:
        lora_layers(spec, lora, "--omnibal-lora-targets", "--omnibal-lora-rank")
        check_frozen(spec, lora, frozen, "--omnibal-lora-targets", "--omnibal-lora-train")
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


def omnibal_help(description: str) -> argparse.ArgumentParser:
    """The parser that prints the entry point's --help: the --omnibal* flags. Megatron's own
    --help cannot print in megatron-core 0.19.2 (the help of
    --moe-paged-stash-buffer-size-factor-cuda holds a stray '%'), so only ours are listed."""
    return add_omnibal_args(
        argparse.ArgumentParser(
            prog="python -m megatron_omnibal.pretrain_vlm",
            usage="%(prog)s [Megatron-LM training flags] --omnibal [--omnibal-* flags]",
            description=description,
        )
    )


def raising(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser with its errors (an unknown flag, a bad value) raised as OmnibalArgsError,
    so that they are printed once like the others, not as a usage text per rank."""

    def error(message: str) -> None:
        raise OmnibalArgsError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def _preparse(argv: list[str]) -> argparse.Namespace:
    """The --omnibal* flags alone, to learn the model before Megatron's parser needs its size."""
    parser = raising(
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
