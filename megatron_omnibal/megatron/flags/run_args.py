"""Megatron's command line of an --omnibal run, completed from the plan and the model before
Megatron parses it.

Why before: Megatron's parser and validate_args act on what they are given (parallel sizes,
the split of the layers, the batch), and only fill a few defaults late in their checks; the
plan and the model already decide all of it. So the flags the plan decides (planner.flags,
the same list `omnibal plan` prints, and the plan's length file) and those the model defines
are added to the command line unless the user gave them. A given flag that changes the split
of the model (a parallel size, a shape flag) and disagrees is an error naming both values; the
global batch only rescales the step (the plan's sizes check notes that once). Nothing here
imports torch or Megatron: the caller passes Megatron's argument parser.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatron_omnibal.megatron.flags.args import OmnibalArgsError
from megatron_omnibal.megatron.flags.moe_args import MOE_SPLIT
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.plan_file.flags import model_flags, run_flags
from megatron_omnibal.planner.plan_file.plan import Plan

# Flags whose value shapes every stage: a given value must be the plan's or the model's.
SPLIT = frozenset({
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size",
    "ffn_hidden_size", "num_attention_heads", "kv_channels", "group_query_attention",
    "num_query_groups", "normalization", "layernorm_epsilon", "swiglu", "position_embedding_type",
    "rotary_base", "vocab_size", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
    "use_rope_scaling", "rope_scaling_factor", "untie_embeddings_and_output_weights",
}) | MOE_SPLIT  # fmt: skip
PRECISIONS = {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> dict[str, Any]:
    """{dest: value} of the flags `argv` really gives (typed as the parser types them)."""
    with _no_defaults(parser):
        ns, _ = parser.parse_known_args(list(argv))
    return vars(ns)


def complete_argv(
    argv: Sequence[str],
    parser: argparse.ArgumentParser,
    spec: ModelSpec,
    plan: Plan | None,
    source: str,
    world_size: int,
) -> list[str]:
    """`argv` with every flag the plan decides (with a plan) and the model defines added where
    `argv` lacks it. `source` names where they come from in messages (the plan's or the
    model's flag). Raises OmnibalArgsError when a given split flag disagrees."""
    given = given_flags(parser, argv)
    implied = model_flags(spec)
    if plan is not None:
        par = plan.parallel
        cp = given.get("context_parallel_size", 1)
        dp = max(1, world_size // (par.tp * par.pp * cp))  # the run's, not the plan's
        implied = run_flags(
            spec, par.tp, par.pp, dp, par.micro_batches, plan.data.token_budget, par.ep
        )
        if plan.data.lengths_path:
            implied += ["--omnibal-lengths", plan_lengths(plan.data.lengths_path, given)]
    implied = _with_precision(implied, given)
    groups = _groups(implied)
    for option, values in groups:
        action = parser._option_string_actions[option]
        if action.dest in given and action.dest in SPLIT:
            want = given_flags(parser, [option, *values])[action.dest]
            _agree(action, given[action.dest], want, source)
    for dest, value in given.items():  # a boolean shape flag the model leaves unset
        action = _action(parser, dest)
        if dest in SPLIT and _is_switch(action) and not any(
            parser._option_string_actions[o].dest == dest for o, _ in groups
        ):
            _agree(action, value, action.default, source)
    out = list(argv)
    for option, values in groups:
        if parser._option_string_actions[option].dest not in given:
            out += [option, *values]
    return out


def plan_lengths(recorded: str, given: dict[str, Any]) -> str:
    """The length file a plan was made from: as recorded, else (a relative path that does not
    exist from here) beside the plan file."""
    path = Path(recorded)
    if path.is_absolute() or path.exists() or "omnibal_plan" not in given:
        return recorded
    beside = Path(given["omnibal_plan"]).parent / path
    return str(beside) if beside.exists() else recorded


def _with_precision(implied: list[str], given: dict[str, Any]) -> list[str]:
    """The plan's precision (bf16) gives way to --omnibal-precision, or to Megatron's own
    --bf16 / --fp16 when given; both given must agree."""
    planned = [f for f in implied if f in ("--bf16", "--fp16")]
    implied = [f for f in implied if f not in ("--bf16", "--fp16")]
    chosen = given.get("omnibal_precision")
    typed = next((p for p in ("bf16", "fp16") if given.get(p)), None)
    if chosen is not None and typed is not None and chosen != typed:
        raise OmnibalArgsError(f"--omnibal-precision {chosen} disagrees with --{typed}")
    if typed is None:
        implied += PRECISIONS[chosen] if chosen is not None else planned
    return implied


def _agree(action: argparse.Action, value: Any, want: Any, source: str) -> None:
    if value != want:
        raise OmnibalArgsError(
            f"{_render(action, value)} disagrees with {source}, which sets "
            f"{_render(action, want)}: drop the flag (or re-plan for it)"
        )


def _render(action: argparse.Action, value: Any) -> str:
    flag = action.option_strings[0]
    if _is_switch(action):
        return flag if value == action.const else f"no {flag}"
    return f"{flag} {value}"


def _is_switch(action: argparse.Action) -> bool:
    return isinstance(action, argparse._StoreConstAction)  # store_true / store_false


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest)


def _groups(flags: Sequence[str]) -> list[tuple[str, list[str]]]:
    """['--a', '1', '--b'] -> [('--a', ['1']), ('--b', [])]."""
    out: list[tuple[str, list[str]]] = []
    for token in flags:
        if token.startswith("--"):
            out.append((token, []))
        else:
            out[-1][1].append(token)
    return out


@contextmanager
def _no_defaults(parser: argparse.ArgumentParser) -> Iterator[None]:
    """The parser with every default suppressed: a parse holds only what was given."""
    saved = [(a, a.default) for a in parser._actions]
    saved_defaults = dict(parser._defaults)
    try:
        for a in parser._actions:
            a.default = argparse.SUPPRESS
        parser._defaults.clear()
        yield
    finally:
        for a, default in saved:
            a.default = default
        parser._defaults.update(saved_defaults)
