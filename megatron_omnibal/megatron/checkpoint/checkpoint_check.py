"""Resume checks before any process group: does the checkpoint load at this layout, and does it
continue the same data stream?

Why: Megatron finds out only inside load_checkpoint, collectively, and one failure even ends the
run with exit status 0 (a `torch` checkpoint has no file for a pipeline rank it never had:
"could not load the checkpoint", sys.exit()). A changed data stream it cannot see at all: the
iteration counter then points into another stream and samples are silently trained twice or
never. Here every rank reads rank 0's saved arguments (the small common state of a `torch_dist`
checkpoint, or a memory-mapped `torch` file), compares them with this run and stops with a
message naming both values, before any rank waits in a collective.

What a run stores: `args.omnibal_run` (Megatron saves its whole argument namespace in every
checkpoint) holds the stage layouts, the data-stream identity and the stream's origin.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

from megatron_omnibal.megatron.flags.args import OmnibalArgsError, OmnibalSettings
from megatron_omnibal.megatron.stream.data_identity import (
    StreamIdentity,
    StreamOrigin,
    restarted_origin,
)
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout

RUN_INFO = "omnibal_run"  # the attribute of Megatron's args that checkpoints carry
RUN_INFO_VERSION = 1
# Formats that store each (TP, PP) rank's own modules: they load only at the layout they were
# saved at. torch_dist (Megatron's default) stores global tensors and reshards on load.
LAYOUT_BOUND_FORMATS = ("torch",)


@dataclass(frozen=True)
class SavedRun:
    """What the checkpoint that this run will load says about the run that saved it."""

    path: str  # the iteration's directory
    iteration: int
    format: str
    tp: int
    pp: int
    consumed_samples: int
    vocab_size: int | None
    info: dict[str, Any] | None  # args.omnibal_run of the saving run (None: not recorded)

    @property
    def layouts(self) -> list[dict[str, Any]] | None:
        return None if self.info is None else self.info.get("layouts")

    @property
    def identity(self) -> StreamIdentity | None:
        if self.info is None or "stream" not in self.info:
            return None
        return StreamIdentity.from_dict(self.info["stream"])

    @property
    def origin(self) -> StreamOrigin:
        if self.info is None or "origin" not in self.info:
            return StreamOrigin()
        return StreamOrigin.from_dict(self.info["origin"])

    @property
    def lengths_file(self) -> str:
        return "?" if self.info is None else str(self.info.get("lengths_file", "?"))


@dataclass(frozen=True)
class ResumePlan:
    """This run's data stream: its identity, its origin, the iteration training starts at, and
    what rank 0 should tell the user about it."""

    identity: StreamIdentity
    origin: StreamOrigin
    start_iteration: int
    notes: tuple[str, ...] = ()


def stream_identity(settings: OmnibalSettings) -> StreamIdentity:
    """This run's data-stream identity (settings.lengths are the lengths as balanced)."""
    return StreamIdentity.of(
        settings.lengths,
        text_scale=settings.source.text_scale,
        data=settings.data,
        balance=settings.balance,
        lengths_sha256=settings.lengths_sha256,
    )


def run_info(
    settings: OmnibalSettings, identity: StreamIdentity, origin: StreamOrigin
) -> dict[str, Any]:
    """The record stored as args.omnibal_run (plain types: Megatron pickles args)."""
    return {
        "version": RUN_INFO_VERSION,
        "layouts": [st.to_dict() for st in settings.layouts],
        "tp": settings.tp_size,
        "pp": settings.pp_size,
        "stream": identity.to_dict(),
        "origin": origin.to_dict(),
        "lengths_file": settings.lengths_path,
    }


def read_saved_run(load: str | None, ckpt_step: int | None = None) -> SavedRun | None:
    """The checkpoint `--load` (and `--ckpt-step`) will load, or None when there is none."""
    if not load:
        return None
    from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename

    tracker = get_checkpoint_tracker_filename(load)
    iteration, release = -1, False
    if os.path.isfile(tracker):
        iteration, release = _read_tracker(tracker)
    if ckpt_step:
        iteration = ckpt_step
    if iteration < 0:
        return None  # Megatron starts from scratch (or stops with --exit-on-missing-checkpoint)
    path = get_checkpoint_name(load, iteration, release, return_base_dir=True)
    if not os.path.isdir(path):
        raise OmnibalArgsError(f"--load {load}: no checkpoint directory {path}")
    fmt, saved = _saved_args(load, iteration, release, path)
    return SavedRun(
        path=path,
        iteration=iteration,
        format=fmt,
        tp=int(getattr(saved, "tensor_model_parallel_size", 1)),
        pp=int(getattr(saved, "pipeline_model_parallel_size", 1)),
        consumed_samples=int(getattr(saved, "consumed_train_samples", 0)),
        vocab_size=getattr(saved, "vocab_size", None),
        info=getattr(saved, RUN_INFO, None),
    )


def _read_tracker(path: str) -> tuple[int, bool]:
    """(iteration, release) from Megatron's latest_checkpointed_iteration.txt (Megatron itself
    prints an error and exits with status 0 on a bad one)."""
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return 0, True
    if not text.isdigit():
        raise OmnibalArgsError(
            f"--load: {path} holds {text!r}, expected an iteration number or 'release'"
        )
    return int(text), False


def _saved_args(load: str, iteration: int, release: bool, path: str) -> tuple[str, Any]:
    """(format, saved argument namespace) of the checkpoint in `path`, from rank 0's files."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.training.checkpointing import find_checkpoint_rank_0

    if dist_checkpointing.check_is_distributed_checkpoint(path):
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": as intended
            warnings.simplefilter("ignore", UserWarning)
            state = dist_checkpointing.load_common_state_dict(path)
        fmt = "torch_dist"
    else:
        name = find_checkpoint_rank_0(load, iteration, release)
        if name is None or not os.path.isfile(name):
            raise OmnibalArgsError(
                f"--load {load}: {path} holds neither a torch_dist checkpoint (metadata.json) nor "
                "a torch checkpoint of rank 0 (mp_rank_00*/model_optim_rng.pt)"
            )
        # mmap: only the pickled structure is read, not the tensors.
        state = torch.load(name, map_location="cpu", weights_only=False, mmap=True)
        fmt = "torch"
    return fmt, state.get("args")


def _weights_layout(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The parts of a layout that decide which weights a stage holds (recompute does not)."""
    drop = ("vit_recompute", "llm_recompute")
    return [{k: v for k, v in st.items() if k not in drop} for st in layouts]


def _describe(tp: int, pp: int, layouts: list[dict[str, Any]] | None) -> str:
    text = f"TP={tp}, PP={pp}"
    if layouts:
        vit = "+".join(str(st["vit_layers"][1] - st["vit_layers"][0]) for st in layouts)
        llm = "+".join(str(st["llm_layers"][1] - st["llm_layers"][0]) for st in layouts)
        text += f" (ViT layers {vit}, LLM layers {llm})"
    return text


def check_layout(
    saved: SavedRun,
    layouts: tuple[StageLayout, ...],
    tp: int,
    load: str,
    vocab_size: int,
    vit_heads: int = 0,
) -> None:
    """Refuse a checkpoint that cannot load at this run's TP/PP split: a format bound to its
    layout, a vocabulary padded to another size at another TP, or a ViT whose heads are padded
    to another count at another TP (`vit_heads`: the model's real ViT heads)."""
    mine = [st.to_dict() for st in layouts]
    if saved.format in LAYOUT_BOUND_FORMATS:
        same = saved.tp == tp and saved.pp == len(layouts)
        if same and saved.layouts is not None:
            same = _weights_layout(saved.layouts) == _weights_layout(mine)
        if not same:
            raise OmnibalArgsError(
                f"--load {load}: iteration {saved.iteration} is a '{saved.format}' checkpoint "
                f"saved at {_describe(saved.tp, saved.pp, saved.layouts)}; this run has "
                f"{_describe(tp, len(layouts), mine)}. A '{saved.format}' checkpoint holds one "
                "file per (TP, PP) rank with that rank's layers and loads only at the layout it "
                "was saved at. Resume at that layout, or convert it once at that layout with "
                "--ckpt-convert-format torch_dist --ckpt-convert-save DIR and resume from "
                "DIR/torch_dist (a torch_dist checkpoint loads at any TP/PP layout)"
            )
    if saved.tp == tp:
        return
    from megatron_omnibal.megatron.stages.configs import padded_heads, padded_vocab

    paddings = []
    if saved.vocab_size == vocab_size:
        paddings.append((padded_vocab, vocab_size, lambda before, now: (
            f"the model pads its vocabulary of {vocab_size} to {before} rows; at TP={tp} it "
            f"pads it to {now}, so the word embedding and output layer cannot be resharded. "
            f"Resume at a TP size whose padding gives {before} rows (TP={saved.tp})")))
    if vit_heads:
        paddings.append((padded_heads, vit_heads, lambda before, now: (
            f"the ViT's {vit_heads} attention heads are padded to {before}; at TP={tp} they "
            f"are padded to {now}, so its attention weights cannot be resharded. Resume at "
            f"a TP size that pads them to {before} heads, or export the checkpoint "
            "(omnibal convert megatron-to-hf) and convert it again at the new TP")))
    for padded, count, explain in paddings:
        before, now = padded(count, saved.tp), padded(count, tp)
        if before != now:
            raise OmnibalArgsError(
                f"--load {load}: iteration {saved.iteration} was saved at TP={saved.tp}, where "
                + explain(before, now)
            )


def check_resume(settings: OmnibalSettings, vit_heads: int = 0) -> ResumePlan:
    """Read the checkpoint this run will load (if any), refuse what cannot resume, and say
    where the data stream starts. `vit_heads`: the model's ViT attention heads."""
    saved = read_saved_run(settings.load, settings.ckpt_step)
    if saved is not None:
        check_layout(
            saved,
            settings.layouts,
            settings.tp_size,
            str(settings.load),
            settings.vocab_size,
            vit_heads,
        )
    return plan_resume(
        saved,
        stream_identity(settings),
        allow_data_change=settings.allow_data_change,
        finetune=settings.restart_stream,
        load=str(settings.load),
        lengths_file=settings.lengths_path,
    )


def plan_resume(
    saved: SavedRun | None,
    identity: StreamIdentity,
    *,
    allow_data_change: bool,
    finetune: bool,
    load: str,
    lengths_file: str,
) -> ResumePlan:
    """The origin of this run's stream: the checkpoint's when the stream is the same, a new one
    when a change is allowed; a changed stream without permission is refused."""
    if saved is None or finetune:
        return ResumePlan(identity, StreamOrigin(), 0)  # training (re)starts at iteration 0
    try:
        old = saved.identity
    except ValueError as exc:  # saved by another version: cannot be compared
        old, listed = None, f"its {exc}, from another version of megatron-omnibal"
    else:
        if old is None:
            note = (
                f"--load {load}: iteration {saved.iteration} records no data-stream identity "
                "(saved without --omnibal or by an older megatron-omnibal); resuming the stream "
                f"at iteration {saved.iteration} without checking that the data is the same"
            )
            return ResumePlan(identity, StreamOrigin(), saved.iteration, (note,))
        changes = old.differences(identity)
        if not changes:
            return ResumePlan(identity, saved.origin, saved.iteration)
        listed = "; ".join(
            _change(name, a, b, saved.lengths_file, lengths_file) for name, a, b in changes
        )
    if not allow_data_change:
        raise OmnibalArgsError(
            f"--load {load}: iteration {saved.iteration} was trained on another data stream: "
            f"{listed}. At the same iteration this run would read other samples (some twice, "
            "some never). Resume with the checkpoint's settings, or pass "
            "--omnibal-allow-data-change to start a new epoch plan at the checkpoint's "
            f"{saved.consumed_samples} consumed samples"
        )
    origin = restarted_origin(saved.iteration, saved.consumed_samples, identity.num_samples)
    note = (
        f"--omnibal-allow-data-change: the data stream changed since iteration "
        f"{saved.iteration} ({listed}); iteration {saved.iteration + 1} starts epoch "
        f"{origin.epoch} of a new balanced plan, counting on from "
        f"{origin.consumed_samples} consumed samples"
    )
    return ResumePlan(identity, origin, saved.iteration, (note,))


def _change(name: str, saved: Any, now: Any, saved_file: str, lengths_file: str) -> str:
    if name == "lengths_sha256":
        return (
            f"lengths: checkpoint {saved_file} (sha256 {str(saved)[:12]}), this run "
            f"{lengths_file} (sha256 {str(now)[:12]})"
        )
    return f"{name}: checkpoint {saved}, this run {now}"
