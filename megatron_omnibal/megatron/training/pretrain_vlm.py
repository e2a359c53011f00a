"""Entry point on megatron.training.pretrain for balanced VLM training.

`python -m megatron_omnibal.pretrain_vlm <Megatron flags> --omnibal ...` (and the patched
Megatron-LM pretrain_vlm.py, which calls `main()`): Megatron's own flags drive training
(optimizer, schedule, checkpoints, logging, parallel sizes); the --omnibal* flags choose the model
dimensions (a plan's model_spec or --omnibal-model), the stage layout and per-stage recompute
(plan or flags) and the balanced data. Everything is validated before Megatron creates a process
group. On a CPU-only torch it runs through enable_cpu_megatron() with gloo; on GPUs unchanged.

Laid out as Megatron-LM's pretrain_vlm.py: model provider, forward step (stages/step.py),
datasets provider (stream/iterators.py), `pretrain(...)`; the flags' checks are in flags/, the
functions of megatron.training replaced in place in runtime/megatron_patches.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from megatron_omnibal.megatron.checkpoint.checkpoint_check import (
    RUN_INFO,
    ResumePlan,
    check_resume,
    run_info,
)
from megatron_omnibal.megatron.flags.args import OmnibalArgsError, OmnibalSettings, add_omnibal_args
from megatron_omnibal.megatron.flags.prepare import (
    config_overrides,
    megatron_defaults,
    omnibal_help,
    prepare_run,
    store_run_args,
    with_run_defaults,
)
from megatron_omnibal.megatron.runtime.compat import ensure_typing_override
from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron
from megatron_omnibal.megatron.runtime.megatron_patches import (
    skip_runtime_helper_build,
    wrap_forward_backward_func,
)
from megatron_omnibal.megatron.runtime.notes import note_fallbacks, quiet_fallback_warnings
from megatron_omnibal.megatron.runtime.stderr import write_line
from megatron_omnibal.megatron.stages.finetune import install_vit_lr_override
from megatron_omnibal.megatron.stages.layout import embedding_ranks
from megatron_omnibal.megatron.stream.iterators import (
    build_data_iterators,
    chunk_streams,
    node_plans,
)
from megatron_omnibal.megatron.training.lora_checkpoints import install_lora_checkpoints
from megatron_omnibal.megatron.training.run_log import install_run_log

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
    batching, the preflight's stream), with the signature of build_data_iterators.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_fallback_warnings()
    cpu = enable_cpu_megatron()
    skip_runtime_helper_build()
    if "-h" in argv or "--help" in argv:
        return _help()
    ensure_typing_override()  # megatron.training on Python 3.11, on GPUs too
    try:
        argv, settings, spec, resume, source = prepare(with_run_defaults(argv, cpu))
    except (OmnibalArgsError, ValueError) as exc:
        return _fail(exc)
    note_fallbacks()
    from megatron.training.arguments import parse_and_validate_args

    sys.argv = [sys.argv[0], *argv]  # Megatron's parser reads sys.argv
    args = parse_and_validate_args(
        extra_args_provider=add_omnibal_args, args_defaults=megatron_defaults(spec)
    )
    store_run_args(args, settings, spec)
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
    """Every check of the run before Megatron validates (and prints) its arguments or creates
    a process group (flags/prepare.py), and where a resumed run's data stream starts."""
    argv, settings, spec, source = prepare_run(argv)
    return argv, settings, spec, check_resume(settings, spec.vit.num_attention_heads), source


def model_provider(
    settings: OmnibalSettings,
    spec: Any,
    overrides: dict[str, Any],
    built: list[Any],
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    pg_collection: Any = None,
    expert_load: Any = None,
    **_: Any,
) -> Any:
    """This rank's stage, or its model chunk `vp_stage` (appended to `built`: with a tied
    output head the rank's chunks are tied once the last is built, tied_head.py); its routers
    counted by `expert_load` (a mixture-of-experts LLM's stages/expert_load.ExpertLoad)."""
    from megatron_omnibal.megatron.stages.provider import vlm_model_provider
    from megatron_omnibal.megatron.stages.tied_head import tie_chunks

    chunk = vlm_model_provider(
        spec, list(settings.layouts), pre_process, post_process, vp_stage,
        config_overrides=overrides, pg_collection=pg_collection, finetune=settings.finetune,
        level_recompute=settings.level_recompute, lora=settings.lora, seed=settings.seed,
    )  # fmt: skip
    if expert_load is not None:
        expert_load.add(chunk)
    if vp_stage is not None:
        built.append(chunk)
        if vp_stage == settings.vpp - 1 and spec.llm.tie_embeddings:
            tie_chunks(built)
    return chunk


def train(
    args: argparse.Namespace,
    settings: OmnibalSettings,
    spec: Any,
    resume: ResumePlan,
    forward_step_func: ForwardStep | None = None,
    build_iterators: IteratorsBuilder | None = None,
    source: Any = None,
) -> None:
    """megatron.training.pretrain with the VLM stage provider and the balanced iterator, from
    `resume`'s place in the stream (`source`: the data source prepare opened, None: synthetic).
    With the package's own iterator the run log shows the balance figures (run_log.py); a
    replaced `build_iterators` has no balanced plan to report."""
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    from megatron_omnibal.megatron.stages.step import forward_step, per_step_micro_batches

    # a step of a packing level runs that level's micro-batches (stages/step.py); Megatron's
    # learning-rate schedule keeps counting --global-batch-size per step
    wrap_forward_backward_func(per_step_micro_batches)
    args.calculate_per_token_loss = True  # losses are token sums; Megatron divides globally
    install_vit_lr_override(settings.finetune.vit_lr_mult)
    install_lora_checkpoints(settings)
    args.variable_seq_lengths = True  # balanced micro-batches differ in shape
    args.eval_iters = 0  # the balanced stream is for training; there is no validation split
    # Megatron saves its argument namespace in every checkpoint: the next resume checks this.
    setattr(args, RUN_INFO, run_info(settings, resume.identity, resume.origin))
    cfg = pretrain_cfg_container_from_args(args)
    expert_load = _expert_load(spec)
    if build_iterators is None:
        plans = node_plans(settings, resume)
        install_run_log(settings, resume, spec, plans, _set_consumed,
                        expert_load and partial(expert_load.step_tokens, spec.llm.num_layers,
                                                spec.llm.num_experts))  # fmt: skip
        datasets_provider = partial(build_data_iterators, settings, spec, iteration=_iteration,
                                    origin=resume.origin, plans=plans, source=source,
                                    chunks=chunk_streams(settings))  # fmt: skip
    else:
        datasets_provider = partial(build_iterators, settings, spec)
    # Every rank builds its own iterator: no broadcast from TP rank 0 (training.py reads this).
    datasets_provider.is_distributed = True  # type: ignore[attr-defined]
    pretrain(
        cfg,
        datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step_func or forward_step,
        model_provider=partial(model_provider, settings, spec, config_overrides(args), [],
                               expert_load=expert_load),
        # A tied output head's gradient is summed with the embedding's between their stages.
        get_embedding_ranks=embedding_ranks(settings.layouts, settings.pp_size),
        get_position_embedding_ranks=_first_rank,
    )


def _expert_load(spec: Any) -> Any:
    """The counter of a mixture-of-experts LLM's tokens per expert (None: dense)."""
    if not spec.llm.is_moe:
        return None
    from megatron_omnibal.megatron.stages.expert_load import ExpertLoad

    return ExpertLoad()


def _iteration() -> int:  # Megatron's, once it loaded its checkpoint
    from megatron.training import get_args

    return get_args().iteration


def _set_consumed(samples: int) -> None:  # Megatron's count of samples trained
    from megatron.training import get_args

    get_args().consumed_train_samples = samples


def _first_rank(pp_ranks: list[int], *_: Any) -> list[int]:
    return list(pp_ranks[:1])


def _help() -> int:
    """The --omnibal* flags (flags/prepare.py: why Megatron's own are not listed)."""
    omnibal_help(description=__doc__.split("\n\n")[1]).print_help()
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
