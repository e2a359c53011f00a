"""torchrun worker: count the host-device synchronisations of a training step's stage forwards.

Usage: torchrun --nproc-per-node 2 sync_worker.py SPEC.json OUT.json
A real PP=2 stage (ViT split over both stages, recompute on some layers) trains one step of
three micro-batches (images, a text-only dummy tile, no tile) through megatron-core's 1F1B
schedule. While a stage's forward or the loss runs, a TorchFunctionMode counts every call that
reads a device value back to the host on a GPU (.item(), .tolist(), .cpu(), bool()/int() of a
tensor, nonzero, boolean indexing, repeat_interleave without output_size, torch.cuda.synchronize).
A positive control counts the old on-device batch check under the same counter.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron

enable_cpu_megatron()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from schedule import run_schedule  # noqa: E402

from megatron_omnibal.data.lengths import from_arrays  # noqa: E402
from megatron_omnibal.megatron.stages.layout import layout_from_counts  # noqa: E402
from megatron_omnibal.megatron.stages.provider import vlm_model_provider  # noqa: E402
from megatron_omnibal.megatron.stages.step import forward_step, loss_func  # noqa: E402
from megatron_omnibal.megatron.stream.batch import collate, synthetic_sample, validate_batch  # noqa: E402
from megatron_omnibal.models.spec import ModelSpec  # noqa: E402

READ_BACK = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
             "nonzero", "masked_select", "unique", "argwhere"}  # fmt: skip


# Host-only by construction on every machine: megatron-core's RNG tracker compares
# torch.get_rng_state() (always a CPU tensor) with its saved copy when a fork ends.
HOST_ONLY = ("megatron/core/tensor_parallel/random.py",)
TORCH = os.path.dirname(torch.__file__)


class SyncCounter(TorchFunctionMode):
    """Counts calls that make a GPU wait for the device (by name, see READ_BACK), each with
    the caller outside torch that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        frame = sys._getframe(1)
        while frame.f_code.co_filename.startswith(TORCH):
            frame = frame.f_back
        if frame.f_code.co_filename.endswith(HOST_ONLY):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        where = f" at {frame.f_code.co_filename}:{frame.f_lineno}"
        if name in READ_BACK:
            self.calls.append(name + where)
        elif name == "__getitem__" and _bool_index(args[1]):
            self.calls.append("boolean indexing" + where)
        elif name == "repeat_interleave" and isinstance(args[1] if len(args) > 1 else
                                                        kwargs.get("repeats"), torch.Tensor) \
                and kwargs.get("output_size") is None:
            self.calls.append("repeat_interleave without output_size" + where)
        elif name == "to" and "cpu" in {str(a) for a in (*args[1:], *kwargs.values())}:
            self.calls.append("to(cpu)" + where)
        return func(*args, **kwargs)


def _bool_index(index: Any) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def main() -> None:
    spec = ModelSpec.from_dict(json.loads(Path(sys.argv[1]).read_text()))
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(1, 2)
    model_parallel_cuda_manual_seed(0)
    layouts = layout_from_counts([3, 1], [0, 4], [1, 1], [0, 2], spec.vit.num_layers,
                                 spec.llm.num_layers)  # fmt: skip
    rank = ps.get_pipeline_model_parallel_rank()
    model = vlm_model_provider(spec, layouts, rank == 0, rank == 1)
    model.train()
    records = [[2, 20, 2], [1, 9, 1], [1, 12, 0], [0, 10, 0], [0, 7, 0]]
    stats = from_arrays(*[[r[k] for r in records] for k in range(3)])
    samples = [synthetic_sample(i, stats, spec, seed=3) for i in range(len(records))]
    batches = [collate(samples[:2]), collate(samples[2:3]), collate(samples[3:])]

    counter = SyncCounter()
    synchronize = torch.cuda.synchronize

    def counted_synchronize(*args: Any, **kwargs: Any) -> None:
        counter.calls.append("torch.cuda.synchronize")
        synchronize(*args, **kwargs)

    def enter(*_: Any) -> None:
        counter.__enter__()
        torch.cuda.synchronize = counted_synchronize

    def leave(*_: Any) -> None:
        torch.cuda.synchronize = synchronize
        counter.__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave)

    def counted_loss(mask: torch.Tensor, output: torch.Tensor):
        enter()
        try:
            return loss_func(mask, output)
        finally:
            leave()

    def step(data_iterator: Any, stage: torch.nn.Module):
        output, loss = forward_step(data_iterator, stage)
        return output, lambda out: counted_loss(loss.args[0], out)

    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    losses = run_schedule(step, model, batches)
    stage_calls = list(counter.calls)
    b = batches[0]
    with counter:
        validate_batch(spec, b.tokens, b.labels, b.images, b.image_flags, b.cu_seqlens)
    control = counter.calls[len(stage_calls):]
    result = {"stage": rank, "forwards": len(forwards), "calls": stage_calls,
              "control": control, "losses": len(losses or [])}  # fmt: skip
    (out.parent / f"{out.stem}.stage{rank}.json").write_text(json.dumps(result))
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
