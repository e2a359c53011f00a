"""The OmniBal part of the training log: a start-up summary, and per iteration what the step
carried and how balanced it was, in the text log, TensorBoard and W&B.

Why: Megatron logs loss and time per iteration but nothing about the pipeline layout, the
budgets or the balance a run is paying for, and its "consumed samples" counts micro-batches
(packs of several samples here). Every figure below comes from the balancer's plan
(stream_steps.StreamSteps), which every rank computes alike, so nothing is communicated; a
mixture-of-experts LLM adds the experts' token load of each step, summed over the ranks by one
small all-reduce per step (stages/expert_load.py).

How: Megatron's train loop calls `megatron.training.training.training_log` after every
iteration on every rank and offers no hook for extra figures; `install` wraps that function (the
only place this module touches Megatron): before it runs, Megatron's consumed samples are set to the
samples trained so far (so Megatron's log line, its TensorBoard "vs samples" axes and the
checkpoint count samples), after it the OmniBal line and scalars follow Megatron's, on the rank
that prints and writes Megatron's (the last).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatron_omnibal.balance.metrics import dist_ratio
from megatron_omnibal.balance.metrics import max_over_mean as per_step_max_over_mean
from megatron_omnibal.megatron.stream.stream_steps import StepFigures, StreamSteps, max_over_mean
from megatron_omnibal.megatron.training.throughput import Throughput
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout

PREFIX = "omnibal"


def _layers(tower: str, layers: tuple[int, int], recompute: int) -> str:
    first, end = layers
    return f"{tower} layers {first}-{end - 1} (recompute {recompute})"


def _stage_line(rank: int, st: StageLayout) -> str:
    pieces = (
        (st.patch_embed, "patch embedding"),
        (st.num_vit_layers, _layers("ViT", st.vit_layers, st.vit_recompute)),
        (st.projector, "projector"),
        (st.llm_embed, "LLM embedding"),
        (st.num_llm_layers, _layers("LLM", st.llm_layers, st.llm_recompute)),
        (st.head, "head"),
    )
    return f"stage {rank}: " + (", ".join(text for held, text in pieces if held) or "nothing")


def startup_summary(
    *,
    layouts: tuple[StageLayout, ...],
    tp: int,
    dp: int,
    micro_batches: int,
    vit_budget: int,
    token_budget: int,
    num_samples: int,
    lengths_file: str,
    source: str,
    balancer: str,
    steps: StreamSteps,
    start_iteration: int,
    throughput: Throughput | None = None,
    predicted_step_ms: float | None = None,
) -> list[str]:
    """Lines rank 0 prints before training: layout, budgets, the epoch plan and its balance,
    and (with a plan's `predicted_step_ms`) the predicted step with its model TFLOP/s and MFU
    for the first step's samples, which the first step's measured figures follow."""
    epoch, step = steps.locate(start_iteration)
    plan = steps.epoch(epoch)
    samples = plan.samples.sum(axis=1)
    tokens_mm = per_step_max_over_mean(plan.tokens.astype(np.float64))
    tiles_mm = per_step_max_over_mean(plan.tiles.astype(np.float64))
    lines = [
        f"pipeline: TP={tp}, PP={len(layouts)}, DP={dp}, {micro_batches} micro-batches per "
        "step and DP rank",
        *(_stage_line(r, st) for r, st in enumerate(layouts)),
        f"budgets per micro-batch: {vit_budget} image tiles, {token_budget} tokens",
        f"data: {num_samples} samples ({lengths_file}, {source}); {balancer}",
        f"epoch {epoch}: {plan.num_steps} steps, samples per step mean "
        f"{samples.mean():.1f} (min {samples.min()}, max {samples.max()}); per step "
        f"{plan.tiles.sum(axis=1).mean():.1f} tiles, {plan.tokens.sum(axis=1).mean():.1f} tokens",
        f"balance over DP ranks per step (max/mean, 1.0 = perfect): tokens {tokens_mm.mean():.4f} "
        f"(worst {tokens_mm.max():.4f}), tiles {tiles_mm.mean():.4f} (worst "
        f"{tiles_mm.max():.4f}); idle share (OmniBal dist ratio): tokens "
        f"{dist_ratio(plan.tokens.astype(np.float64)).mean():.4f}, tiles "
        f"{dist_ratio(plan.tiles.astype(np.float64)).mean():.4f}",
    ]
    if start_iteration:
        lines.append(
            f"resuming at iteration {start_iteration}: epoch {epoch}, step {step} of the "
            f"balanced plan, {steps.consumed_samples(start_iteration)} samples consumed"
        )
    if throughput is not None and predicted_step_ms is not None and predicted_step_ms > 0:
        first = steps.step(start_iteration)
        lines.append(
            f"plan predicted step {_at(throughput, first, predicted_step_ms / 1e3)} for the "
            f"first step's {first.num_samples} samples (measured: after the first step); "
            f"peak: {throughput.peak_source}"
        )
    return [f"{PREFIX}: {line}" for line in lines]


def _at(throughput: Throughput, figures: StepFigures, seconds: float) -> str:
    """'X ms, model TFLOP/s/GPU y | MFU z' of a step's work done in `seconds`."""
    return f"{1e3 * seconds:.1f} ms, {throughput.describe([figures], seconds)}"


def step_scalars(
    figures: StepFigures, seconds: float, throughput: Throughput | None = None
) -> dict[str, float]:
    """The per-iteration figures under their TensorBoard / W&B names."""
    out = {
        "samples-per-step": float(figures.num_samples),
        "tiles-per-step": float(figures.num_tiles),
        "tokens-per-step": float(figures.num_tokens),
    }
    for kind in ("tokens", "tiles"):
        per_rank = getattr(figures, kind).astype(np.float64)
        out[f"rank-{kind}-max"] = float(per_rank.max())
        out[f"rank-{kind}-mean"] = float(per_rank.mean())
        out[f"rank-{kind}-max-over-mean"] = max_over_mean(per_rank)
    if seconds > 0:
        out["tokens-per-second"] = figures.num_tokens / seconds
        out["samples-per-second"] = figures.num_samples / seconds
        if throughput is not None:
            tflops, fraction = throughput.rates([figures], seconds)
            out["model-tflops-per-gpu"] = tflops
            if fraction is not None:
                out["mfu"] = fraction
    return {f"{PREFIX}/{name}": value for name, value in out.items()}


def expert_figures(tokens: np.ndarray) -> dict[str, float]:
    """A step's expert load from its [MoE layers, experts] token counts: the busiest expert's
    tokens (over all layers), the mean per expert, and max/mean of the most unbalanced layer
    (the straggler of its all-to-all) and averaged over the layers."""
    tokens = np.asarray(tokens, dtype=np.float64)
    ratios = [max_over_mean(row) for row in tokens]
    return {
        "expert-tokens-max": float(tokens.max()),
        "expert-tokens-mean": float(tokens.mean()),
        "expert-tokens-max-over-mean": float(max(ratios)),
        "expert-tokens-max-over-mean-layers-mean": float(np.mean(ratios)),
    }


def first_step_line(
    throughput: Throughput, figures: StepFigures, seconds: float, predicted_ms: float | None
) -> str:
    """The first measured step beside the plan's prediction (MFU of this step's work at the
    predicted time): the start-up check of the plan's model against this cluster."""
    text = f"{PREFIX}: first step measured {_at(throughput, figures, seconds)} (includes warm-up)"
    if predicted_ms is not None and predicted_ms > 0:
        text += f"; plan predicted {_at(throughput, figures, predicted_ms / 1e3)}"
    return text + f"; peak: {throughput.peak_source}"


@dataclass
class IterationLog:
    """Per-iteration figures of the balanced stream, accumulated between text log lines."""

    steps: StreamSteps
    log_interval: int
    tensorboard_interval: int
    is_logger: bool  # the rank that prints Megatron's line and holds its writers
    throughput: Throughput | None = None  # model TFLOP/s per GPU and MFU on every line
    predicted_step_ms: float | None = None  # the plan's, shown beside the first step
    # A mixture-of-experts LLM: the step's [layers, experts] tokens, a collective every rank
    # calls once per step (stages/expert_load.ExpertLoad.step_tokens); None: a dense LLM.
    expert_tokens: Callable[[], np.ndarray] | None = None
    _pending: list[tuple[StepFigures, float]] = field(default_factory=list)
    _experts: list[dict[str, float]] = field(default_factory=list)
    _first_shown: bool = False

    def consumed_samples(self, iteration: int) -> int:
        return self.steps.consumed_samples(iteration)

    def record(
        self,
        iteration: int,
        seconds: float,
        writer: Any = None,
        wandb: Any = None,
        printer: Callable[..., None] = print,
        expert_tokens: np.ndarray | None = None,
    ) -> None:
        """Iteration `iteration` (Megatron's counter after the step) took `seconds`;
        `expert_tokens`: its [MoE layers, experts] token counts (None: a dense LLM)."""
        if not self.is_logger:
            return
        figures = self.steps.step(iteration - 1)
        self._pending.append((figures, seconds))
        experts = expert_figures(expert_tokens) if expert_tokens is not None else None
        if experts is not None:
            self._experts.append(experts)
        if self.throughput is not None and not self._first_shown and seconds > 0:
            self._first_shown = True
            printer(first_step_line(self.throughput, figures, seconds, self.predicted_step_ms),
                    flush=True)  # fmt: skip
        if (writer is not None or wandb is not None) and iteration % self.tensorboard_interval == 0:
            scalars = step_scalars(figures, seconds, self.throughput)
            scalars.update({f"{PREFIX}/{k}": v for k, v in (experts or {}).items()})
            if writer is not None:
                for name, value in scalars.items():
                    writer.add_scalar(name, value, iteration)
            if wandb is not None:
                wandb.log(scalars, iteration)
        if iteration % self.log_interval == 0:
            printer(self._line(iteration), flush=True)
            self._pending.clear()
            self._experts.clear()

    def _line(self, iteration: int) -> str:
        """The figures averaged over the steps since the last line, rates over their time, and
        where the stream stands: the balancer's epoch and the step within it (epochs differ in
        steps; with packing levels also in micro-batches per step)."""
        figs = [f for f, _ in self._pending]
        seconds = sum(s for _, s in self._pending)

        def mean(values: list[float]) -> float:
            return float(np.mean(values))

        text = (
            f" {PREFIX}: iteration {iteration:8d}"
            f" | samples/step {mean([f.num_samples for f in figs]):.1f}"
            f" | tiles/step {mean([f.num_tiles for f in figs]):.1f}"
            f" | tokens/step {mean([f.num_tokens for f in figs]):.1f}"
        )
        for kind in ("tokens", "tiles"):
            per_rank = [getattr(f, kind).astype(np.float64) for f in figs]
            text += (
                f" | per-rank {kind} max {mean([p.max() for p in per_rank]):.1f} mean "
                f"{mean([p.mean() for p in per_rank]):.1f} (max/mean "
                f"{mean([max_over_mean(p) for p in per_rank]):.4f})"
            )
        if self._experts:
            ex = {k: mean([e[k] for e in self._experts]) for k in self._experts[0]}
            text += (
                f" | expert tokens max {ex['expert-tokens-max']:.1f} mean "
                f"{ex['expert-tokens-mean']:.1f} (max/mean "
                f"{ex['expert-tokens-max-over-mean']:.4f} worst layer, "
                f"{ex['expert-tokens-max-over-mean-layers-mean']:.4f} over layers)"
            )
        if seconds > 0:
            text += (
                f" | tokens/s {sum(f.num_tokens for f in figs) / seconds:.1f}"
                f" | samples/s {sum(f.num_samples for f in figs) / seconds:.1f}"
            )
            if self.throughput is not None:
                text += f" | {self.throughput.describe(figs, seconds)}"
        epoch, step = self.steps.locate(iteration - 1)
        return text + f" | epoch {epoch} step {step + 1}/{self.steps.epoch(epoch).num_steps} |"


def install(log: IterationLog, set_consumed: Callable[[int], None]) -> None:
    """Wrap Megatron's training_log: samples in "consumed samples" (`set_consumed` writes
    Megatron's count), then the OmniBal figures.

    An iteration's time is read from Megatron's own "interval-time" timer (the one behind its
    "elapsed time per iteration"), which pauses while a checkpoint is saved.
    """
    from megatron.training import global_vars, training

    orig = getattr(training.training_log, "__wrapped_by_omnibal__", training.training_log)
    signature = inspect.signature(orig)
    timer_before_log = [0.0]  # the interval timer's reading when the last log call returned

    @functools.wraps(orig)
    def training_log(*a: Any, **k: Any) -> Any:
        iteration = int(signature.bind(*a, **k).arguments["iteration"])
        set_consumed(log.consumed_samples(iteration))
        timer = global_vars.get_timers()("interval-time")
        seconds = timer.elapsed(reset=False) - timer_before_log[0]
        result = orig(*a, **k)
        timer_before_log[0] = timer.elapsed(reset=False)  # Megatron may have reset it
        log.record(
            iteration,
            seconds,
            writer=global_vars.get_tensorboard_writer(),
            wandb=global_vars.get_wandb_writer(),
            expert_tokens=log.expert_tokens() if log.expert_tokens is not None else None,
        )
        return result

    training_log.__wrapped_by_omnibal__ = orig  # type: ignore[attr-defined]
    training.training_log = training_log
