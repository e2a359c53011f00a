"""Checkpoints of a LoRA run through megatron.training: the base from --pretrained-checkpoint,
adapter-only saves, and resuming them, at any layout.

Why wrap megatron.training's load and save: Megatron loads one checkpoint into the whole model
and saves the whole model. A LoRA run starts from a base checkpoint that has no adapters, and
with `--omnibal-lora-save adapters` (the default beside --pretrained-checkpoint) saves only what
trains (adapters, parts trained in full, their optimizer state, RNG, iteration), as PEFT does.
A resume then loads the base from --pretrained-checkpoint first and the run's own checkpoint
over it; torch_dist checkpoints do so at another TP/PP/virtual-stage layout too.
"""

from __future__ import annotations

from typing import Any

from megatron_omnibal.megatron.flags.args import OmnibalSettings


def install_lora_checkpoints(settings: OmnibalSettings) -> None:
    """Wrap megatron.training's load_checkpoint and save_checkpoint for a LoRA run."""
    if settings.lora is None:
        return
    import megatron.training.training as loop

    if getattr(loop.load_checkpoint, "__omnibal__", False):
        return
    from megatron.training import get_args
    from megatron.training.checkpointing import checkpoint_exists

    from megatron_omnibal.megatron.stages.lora import checkpoint_view

    load, save = loop.load_checkpoint, loop.save_checkpoint
    saved_view = "trainable" if settings.lora_save == "adapters" else "all"

    def load_checkpoint(model: Any, optimizer: Any, scheduler: Any, *args: Any,
                        **kwargs: Any) -> Any:  # fmt: skip
        margs = get_args()
        if margs.load is None or not checkpoint_exists(margs.load):
            # a fresh start: Megatron loads --pretrained-checkpoint, the base (no adapters)
            with checkpoint_view(model, "base"):
                return load(model, optimizer, scheduler, *args, **{**kwargs, "strict": False})
        if saved_view == "all":
            return load(model, optimizer, scheduler, *args, **kwargs)
        finetune, step = margs.finetune, margs.ckpt_step
        margs.finetune = True  # the base alone: no optimizer, RNG or iteration from it
        margs.ckpt_step = None  # --ckpt-step names the run's own checkpoint, not the base's
        try:
            with checkpoint_view(model, "base"):
                load(model, None, None, *args,
                     **{**kwargs, "strict": False, "load_arg": "pretrained_checkpoint"})
        finally:
            margs.finetune, margs.ckpt_step = finetune, step
        with checkpoint_view(model, "trainable"):
            return load(model, optimizer, scheduler, *args, **{**kwargs, "strict": False})

    def save_checkpoint(iteration: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        with checkpoint_view(model, saved_view):
            return save(iteration, model, *args, **kwargs)

    load_checkpoint.__omnibal__ = True  # type: ignore[attr-defined]
    loop.load_checkpoint = load_checkpoint
    loop.save_checkpoint = save_checkpoint
