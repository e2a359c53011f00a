"""The run's own log, set up before megatron.training.pretrain starts: the start-up summary and
notes (rank 0) and the per-iteration OmniBal figures (training_log.py).

Why a module of its own: the entry point only composes the run; what the log shows of the plan,
the budgets and the throughput is this module's to decide.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_omnibal.megatron.checkpoint.checkpoint_check import ResumePlan
from megatron_omnibal.megatron.flags.args import OmnibalSettings


def install_run_log(
    settings: OmnibalSettings,
    resume: ResumePlan,
    spec: Any,
    plans: Any,
    set_consumed: Callable[[int], None],
    expert_tokens: Callable[[], Any] | None = None,
) -> None:
    """The start-up summary and notes (rank 0) and the per-iteration log (installed into
    Megatron's training_log on every rank: every rank counts consumed samples). `plans`: the
    node's epoch plans (stream/iterators.node_plans; None: balanced in this process);
    `set_consumed` writes Megatron's count of consumed samples; `expert_tokens` the step's
    token load of a mixture-of-experts LLM (training_log.IterationLog; None: dense)."""
    from megatron_omnibal.megatron.stream.iterators import balanced_sampler
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
        expert_tokens=expert_tokens,
    )
    training_log.install(log, set_consumed)
