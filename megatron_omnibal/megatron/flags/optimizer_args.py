"""The optimizer's flags, checked before Megatron validates (and prints) its arguments.

Why: megatron-core 0.19 takes a run without `--lr` (its default is None) all the way to the
optimizer, where torch's Adam raises a TypeError on every rank; inconsistent learning-rate
flags stop in its validation or in its scheduler with a bare assert, again on every rank. Here
each is one error naming the flags. A preflight measures time and memory, which the learning
rate does not change: it runs with `PREFLIGHT_LR` when none is given.
"""

from __future__ import annotations

import argparse
import math

from megatron_omnibal.megatron.flags.args import OmnibalArgsError

PREFLIGHT_LR = 1e-5


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def check_optimizer_args(args: argparse.Namespace, schedule: bool = True) -> None:
    """Raise OmnibalArgsError for a missing or inconsistent optimizer flag. `schedule`: the
    run's length is known, so warm-up and decay lengths are checked against each other."""
    lr, min_lr = args.lr, args.min_lr
    if lr is None:
        raise OmnibalArgsError("no learning rate: give --lr (e.g. --lr 2e-5; omnibal finetune's "
                               "default), and --min-lr for the end of the decay")
    if not _number(lr) or lr < 0:
        raise OmnibalArgsError(f"--lr {lr}: a learning rate is a number >= 0")
    if not _number(min_lr) or not 0 <= min_lr <= lr:
        raise OmnibalArgsError(f"--min-lr {min_lr}: must be from 0 to --lr {lr}")
    init = getattr(args, "lr_warmup_init", 0.0)
    if init is not None and not 0 <= init <= lr:
        raise OmnibalArgsError(f"--lr-warmup-init {init}: must be from 0 to "
                               f"--lr {lr}")
    for flag in ("lr_warmup_samples", "lr_decay_samples"):
        if getattr(args, flag, None):
            raise OmnibalArgsError(f"--{flag.replace('_', '-')}: with --omnibal a step trains a "
                                   "varying number of samples; give the schedule in iterations "
                                   "(--lr-warmup-iters or --lr-warmup-fraction, --lr-decay-iters)")
    fraction, warmup = args.lr_warmup_fraction, args.lr_warmup_iters or 0
    if fraction is not None and warmup:
        raise OmnibalArgsError(f"--lr-warmup-fraction {fraction} and --lr-warmup-iters {warmup}: "
                               "give one of them")
    if fraction is not None and not 0 <= fraction < 1:
        raise OmnibalArgsError(f"--lr-warmup-fraction {fraction}: must be in [0, 1)")
    decay = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    if schedule and decay is not None:
        if decay <= 0:
            raise OmnibalArgsError(f"--lr-decay-iters {decay}: must be positive")
        if warmup >= decay:
            raise OmnibalArgsError(f"--lr-warmup-iters {warmup}: the warm-up must end before the "
                                   f"decay does ({decay} iterations, --lr-decay-iters or else "
                                   "--train-iters)")
    if args.optimizer == "adam":
        for flag in ("adam_beta1", "adam_beta2"):
            value = getattr(args, flag)
            if not _number(value) or not 0 <= value < 1:
                raise OmnibalArgsError(f"--{flag.replace('_', '-')} {value}: must be in [0, 1)")
        if not _number(args.adam_eps) or args.adam_eps <= 0:
            raise OmnibalArgsError(f"--adam-eps {args.adam_eps}: must be positive")
    if not _number(args.weight_decay) or args.weight_decay < 0:
        raise OmnibalArgsError(f"--weight-decay {args.weight_decay}: must be >= 0")
    ends = (args.start_weight_decay, args.end_weight_decay)
    if args.weight_decay_incr_style == "constant" and ends != (None, None):
        raise OmnibalArgsError("--start-weight-decay / --end-weight-decay need "
                               "--weight-decay-incr-style linear or cosine (it is constant)")
    if args.weight_decay_incr_style != "constant" and None in ends:
        raise OmnibalArgsError(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs "
                               "--start-weight-decay and --end-weight-decay")
    if not _number(args.clip_grad) or args.clip_grad < 0:
        raise OmnibalArgsError(f"--clip-grad {args.clip_grad}: must be >= 0 (0: no clipping)")
