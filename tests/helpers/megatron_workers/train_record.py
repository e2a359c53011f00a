"""torchrun worker: train through megatron_omnibal's real entry point and record, per micro-batch,
the sample indices this rank read and (last pipeline stage) the loss sum and token count.

Usage: torchrun --nproc-per-node N train_record.py OUT_DIR <Megatron and --omnibal flags>
Writes OUT_DIR/rank{R}.json: {"rank", "pp_rank", "dp_rank", "start", "micro": [{"indices",
"loss"?, "tokens"?}, ...], "flops_per_sample"}, micro-batches in the order Megatron's schedule
drew them ("chunk": the model chunk that ran it, 0 without virtual stages; flops_per_sample:
Megatron's own FLOPs figure of one sample), and exits
with main()'s status (2 on a bad flag, before any process group). A stop by --exit-interval
(Megatron's sys.exit after its checkpoint) still writes the records.

With OMNIBAL_WATCH_DIR set, every file this rank or its DataLoader worker processes open under
that folder is appended to OUT_DIR/opened_rank{R}.txt (a Python audit hook, inherited by the
forked workers; it sees Pillow's opens too).

Each micro-batch record also holds its `level` and, under "checkpointed", the ViT/LLM layers
("vit.3", "llm.0", global numbering) whose forward ran without autograd (the first pass of a
recomputed layer); "recomputed" counts, per layer, the forwards run during backward passes.
With OMNIBAL_TEST_WEIGHTS=SEED a run that starts at step 0 sets every parameter from its global
name and SEED (the same weights at any pipeline split); with OMNIBAL_TEST_GRADS=1 the gradient
each optimizer step applies is saved per global name to OUT_DIR/grads_rank{R}.pt.
A tied output head's copy of the embedding (`output_layer.weight` beside a stage's
`embedding.word_embeddings.weight` elsewhere) takes the embedding's test weights. With
RECORD_BUILT_PARAMS=1 the parameters as the model chunks were built (before the test weights)
go to OUT_DIR/built{R}.pt under their model-wide names.
With RECORD_PARAMS_AT_STEP=S, the stage's parameters as step S runs (after S optimizer steps, or
as loaded) go to OUT_DIR/params{R}.pt under their model-wide names.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from collections import Counter
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from megatron_omnibal.megatron.stages.step import forward_step
from megatron_omnibal.megatron.training.pretrain_vlm import main

RECORDS: list[dict] = []
STATE: dict = {"in_forward_step": False, "checkpointed": [], "recomputed": Counter()}
GRADS: list[dict] = []
PARAMS_AT = os.environ.get("RECORD_PARAMS_AT_STEP")
EMBEDDING = "embedding.word_embeddings.weight"


def _stage(model):
    from megatron_omnibal.megatron.stages.model import VLMStage

    while not isinstance(model, VLMStage):  # DDP / Float16Module wrappers
        model = model.module
    return model


def _test_weights(names: dict, seed: int, tied: bool = False) -> None:
    """Every parameter from its global name (a tied head's copy from the embedding's): norms
    around 1, the rest small."""
    with torch.no_grad():
        for name, p in names.items():
            key = EMBEDDING if tied and name == "output_layer.weight" else name
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()) ^ seed)
            value = 0.05 * torch.randn(p.shape, generator=g)
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):
                value += 1.0
            p.copy_(value)


def _watch_layers(stage) -> None:
    def hook(name):
        def count(_module, _args, _output):
            if STATE["in_forward_step"] and not torch.is_grad_enabled():
                STATE["checkpointed"].append(name)
            elif not STATE["in_forward_step"] and torch.is_grad_enabled():
                STATE["recomputed"][name] += 1

        return count

    for tower in ("vit", "llm"):
        block = getattr(stage, tower)
        for layer in block.layers if block is not None else ():
            layer.register_forward_hook(hook(f"{tower}.{layer.layer_number - 1}"))


def _record_grads(names: dict) -> None:
    """Once per process; each model chunk adds its parameters to the names looked up."""
    if "grad_names" in STATE:
        STATE["grad_names"].update({id(p): n for n, p in names.items()})
        return
    by_id = STATE["grad_names"] = {id(p): n for n, p in names.items()}

    def hook(optimizer, _args, _kwargs):
        STATE["optimizer_params"] = sorted({by_id[id(p)] for group in optimizer.param_groups
                                            for p in group["params"] if id(p) in by_id})
        GRADS.append({by_id[id(p)]: p.grad.detach().clone() for group in optimizer.param_groups
                      for p in group["params"] if id(p) in by_id and p.grad is not None})

    register_optimizer_step_pre_hook(hook)


def _first_call(source, stage) -> None:
    """The first forward of a model chunk (one per rank, or one per virtual stage)."""
    from megatron_omnibal.megatron.stages.model import global_named_parameters

    names = global_named_parameters(stage)
    if os.environ.get("RECORD_BUILT_PARAMS"):
        STATE.setdefault("built", {}).update({n: p.detach().clone() for n, p in names.items()})
    seed = os.environ.get("OMNIBAL_TEST_WEIGHTS")
    if seed is not None and source.start_step == 0:
        _test_weights(names, int(seed), stage.spec.llm.tie_embeddings)
    if os.environ.get("OMNIBAL_TEST_GRADS"):
        _record_grads(names)
    _watch_layers(stage)


def recording_forward_step(data_iterator, model):
    source = getattr(data_iterator, "iterable", data_iterator)  # Megatron's RerunDataIterator
    stage = _stage(model)
    if id(stage) not in STATE.setdefault("chunks", set()):
        STATE["chunks"].add(id(stage))
        _first_call(source, stage)
    STATE["in_forward_step"], STATE["checkpointed"] = True, []
    try:
        output, loss_func = forward_step(data_iterator, model)
    finally:
        STATE["in_forward_step"] = False
    if PARAMS_AT is not None and source.step == int(PARAMS_AT):
        from megatron_omnibal.megatron.stages.model import global_named_parameters

        # Drawn and run forward, not yet updated: the parameters step S starts from (each
        # model chunk's, at its first forward of the step).
        saved = STATE.setdefault("params", {})
        for n, p in global_named_parameters(stage).items():
            saved.setdefault(n, p.detach().clone())
    record = {"indices": source.last_indices, "level": source.level,
              "checkpointed": sorted(STATE["checkpointed"]), "chunk": stage.vp_stage or 0}
    RECORDS.append(record)
    STATE["start"] = source.start_step

    def recorded_loss(output_tensor):
        loss_sum, tokens, report = loss_func(output_tensor)
        record["loss"] = float(loss_sum.detach())
        record["tokens"] = int(tokens)
        return loss_sum, tokens, report

    return output, recorded_loss


def watch_opens(out: Path) -> None:
    watched = os.environ.get("OMNIBAL_WATCH_DIR")
    if not watched:
        return
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / f"opened_rank{os.environ['RANK']}.txt", os.O_WRONLY | os.O_CREAT |
                 os.O_APPEND)

    def hook(event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], str | Path) and str(args[0]).startswith(
                watched):
            os.write(fd, f"{args[0]}\n".encode())

    sys.addaudithook(hook)


def run() -> int:
    out = Path(sys.argv[1])
    watch_opens(out)
    try:
        status = main(sys.argv[2:], forward_step_func=recording_forward_step)
    except SystemExit as stop:  # --exit-interval: Megatron saves, then sys.exit()s
        status = stop.code or 0
    if status != 0:
        return status
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.training import get_args
    from megatron.training.training import num_floating_point_operations

    out.mkdir(parents=True, exist_ok=True)
    result = {
        "rank": dist.get_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "start": STATE.get("start"),
        "micro": RECORDS,
        "recomputed": dict(STATE["recomputed"]),
        # Megatron's FLOPs of one sample (its throughput figure), from the run's arguments.
        "flops_per_sample": num_floating_point_operations(get_args(), 1),
        # OMNIBAL_TEST_GRADS: the model-wide names of the parameters the optimizer holds
        "optimizer_params": STATE.get("optimizer_params"),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    if GRADS:
        torch.save(GRADS, out / f"grads_rank{dist.get_rank()}.pt")
    if "built" in STATE:
        torch.save(STATE["built"], out / f"built{dist.get_rank()}.pt")
    if "params" in STATE:
        torch.save(STATE["params"], out / f"params{dist.get_rank()}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(run())
