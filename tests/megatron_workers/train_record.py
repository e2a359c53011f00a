"""torchrun worker: train through megatron_omnibal's real entry point and record, per micro-batch,
the sample indices this rank read and (last pipeline stage) the loss sum and token count.

Usage: torchrun --nproc-per-node N train_record.py OUT_DIR <Megatron and --omnibal flags>
Writes OUT_DIR/rank{R}.json: {"rank", "pp_rank", "dp_rank", "start", "micro": [{"indices",
"loss"?, "tokens"?}, ...]} in the order Megatron's schedule drew the micro-batches, and exits
with main()'s status (2 on a bad flag, before any process group). A stop by --exit-interval
(Megatron's sys.exit after its checkpoint) still writes the records.

With OMNIBAL_WATCH_DIR set, every file this rank or its DataLoader worker processes open under
that folder is appended to OUT_DIR/opened_rank{R}.txt (a Python audit hook, inherited by the
forked workers; it sees Pillow's opens too).
With RECORD_PARAMS_AT_STEP=S in the environment, the stage's parameters as the step with
iteration counter S starts (after S optimizer steps, or as loaded) go to OUT_DIR/params{R}.pt
under their model-wide names (megatron.model.global_named_parameters).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from megatron_omnibal.megatron.pretrain_vlm import main
from megatron_omnibal.megatron.step import forward_step

RECORDS: list[dict] = []
STATE: dict = {}
PARAMS_AT = os.environ.get("RECORD_PARAMS_AT_STEP")


def snapshot_parameters(model) -> dict:
    from megatron_omnibal.megatron.model import global_named_parameters

    while hasattr(model, "module"):  # DDP / Float16Module wrappers
        model = model.module
    return {name: p.detach().clone() for name, p in global_named_parameters(model).items()}


def recording_forward_step(data_iterator, model):
    source = getattr(data_iterator, "iterable", data_iterator)  # Megatron's RerunDataIterator
    if PARAMS_AT is not None and source.step == int(PARAMS_AT) and "params" not in STATE:
        STATE["params"] = snapshot_parameters(model)
    output, loss_func = forward_step(data_iterator, model)
    record = {"indices": source.last_indices}
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

    out.mkdir(parents=True, exist_ok=True)
    result = {
        "rank": dist.get_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
        "start": STATE.get("start"),
        "micro": RECORDS,
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    if "params" in STATE:
        import torch

        torch.save(STATE["params"], out / f"params{dist.get_rank()}.pt")
    return 0


if __name__ == "__main__":
    sys.exit(run())
