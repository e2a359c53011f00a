"""What a preflight measures on one rank, per training step: its stage's peak memory, the
forward and backward time of each micro-batch, and the step's wall time.

Memory on a GPU is the caching allocator's peak (`max_memory_allocated`, reset every step). On a
CPU there is no allocator to ask, so the tracked bytes are the stage's static state (parameters,
gradient buffers, optimizer state: every distinct storage reachable from them) plus the peak of
the activations autograd holds for the backward (saved-tensor hooks count each storage once while
any of its saved tensors is alive; recomputation's re-run forward included). Times are taken with
the device synchronised around each forward (Megatron's schedule calls our forward step) and each
backward (megatron-core's schedules.backward_step), which a preflight may afford.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

GIB = 2.0**30


class SavedTensorTracker:
    """Bytes of distinct storages autograd holds for the backward, and their peak.

    Storages in `exclude` (parameters, gradient buffers) are static state, not activations.
    """

    def __init__(self, exclude: Iterable[int] = ()) -> None:
        self.exclude = set(exclude)
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved tensors alive]
        self.bytes = 0
        self.peak = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def reset_peak(self) -> None:
        self.peak = self.bytes

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return tensor
        entry = self.live.setdefault(key, [storage.nbytes(), 0])
        if entry[1] == 0:
            self.bytes += entry[0]
            self.peak = max(self.peak, self.bytes)
        entry[1] += 1
        return _Held(tensor, self, key)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[key]


class _Held:
    """A saved tensor whose release (when autograd frees the graph) the tracker hears of."""

    __slots__ = ("tensor", "tracker", "key")

    def __init__(self, tensor: torch.Tensor, tracker: SavedTensorTracker, key: int) -> None:
        self.tensor, self.tracker, self.key = tensor, tracker, key

    def __del__(self) -> None:
        self.tracker._release(self.key)


def _unpack(held: Any) -> torch.Tensor:
    return held.tensor if isinstance(held, _Held) else held


STATIC_PARTS = ("weights", "gradients", "optimizer")


def static_parts(model: Iterable[torch.nn.Module], optimizer: Any) -> dict[str, dict[int, int]]:
    """{part: {storage pointer: bytes}} of the stage's static state, each storage once, in the
    first part that holds it: the parameters ("weights"), their gradient buffers
    ("gradients"), the optimizer's state and FP32 main copies of 16-bit parameters
    ("optimizer"). Split so that each can be set against the planner's model of it."""
    tensors: dict[str, list[torch.Tensor]] = {part: [] for part in STATIC_PARTS}
    for chunk in model:
        for p in chunk.parameters():
            tensors["weights"].append(p)
            for name in ("main_grad", "grad"):
                if isinstance(getattr(p, name, None), torch.Tensor):
                    tensors["gradients"].append(getattr(p, name))
    for opt in _torch_optimizers(optimizer):
        for state in opt.state.values():
            tensors["optimizer"] += [v for v in state.values() if isinstance(v, torch.Tensor)]
        for group in opt.param_groups:
            tensors["optimizer"] += list(group["params"])
    out: dict[str, dict[int, int]] = {part: {} for part in STATIC_PARTS}
    seen: set[int] = set()
    for part in STATIC_PARTS:
        for t in tensors[part]:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                out[part][s.data_ptr()] = s.nbytes()
    return out


def static_storages(model: Iterable[torch.nn.Module], optimizer: Any) -> dict[int, int]:
    """{storage pointer: bytes} of parameters, their gradient buffers and the optimizer state."""
    return {k: v for part in static_parts(model, optimizer).values() for k, v in part.items()}


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    found = []
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer.optimizer]:
        found += _torch_optimizers(inner)
    return found


@dataclass
class StepRecord:
    """One training step on this rank."""

    label: str
    step_ms: float = 0.0
    forward_ms: list[float] = field(default_factory=list)
    backward_ms: list[float] = field(default_factory=list)
    static_bytes: int = 0
    static_part_bytes: dict[str, int] = field(default_factory=dict)  # STATIC_PARTS' bytes
    activation_peak_bytes: int = 0
    allocator_peak_bytes: int | None = None  # GPU only
    schedule_ms: float = 0.0  # from this stage's first forward step to its last backward
    # per tower ("vit", "llm"), per layer of this stage: [activation bytes it stored (largest
    # micro-batch), bytes of its input (what recomputing it still stores), forward ms (mean)]
    layers: dict[str, list[list[float]]] = field(default_factory=dict)
    # [tiles, tokens, the sum of squared lengths its attention runs over] of each micro-batch
    batches: list[list[int]] = field(default_factory=list)
    # per tower, each micro-batch's forward ms in this stage's layers of that tower (together)
    tower_ms: dict[str, list[float]] = field(default_factory=dict)
    # each micro-batch's forward step as the schedule runs it: its data, the batch's checks and
    # copy, the stage's forward and (last stage) the loss
    call_ms: list[float] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        if self.allocator_peak_bytes is not None:
            return self.allocator_peak_bytes
        return self.static_bytes + self.activation_peak_bytes


def sync_device() -> None:
    """Wait for the GPU's queued work (a no-op on a CPU), so a wall time covers it."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(record: Callable[[float], None], fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, with its synchronised wall time in ms handed to `record` after each call."""

    def run(*args: Any, **kwargs: Any) -> Any:
        sync_device()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sync_device()
        record(1e3 * (time.perf_counter() - start))
        return out

    return run


class StepMeter:
    """Installs the measurements into Megatron's training loop of this process and keeps one
    StepRecord per training step; `labels[k]` names step k (worst or typical)."""

    def __init__(self, labels: list[str], gpu: bool) -> None:
        self.labels = labels
        self.gpu = gpu
        self.steps: list[StepRecord] = []
        self.tracker = SavedTensorTracker()
        self._hooked = False
        self._in_backward = False
        self._schedule: list[float | None] = [None, None]  # this step's first and last pass
        # True when the stage's attention runs over the whole packed micro-batch under a mask
        # (the local layer specs), False when over each packed sample (Transformer Engine)
        self.masked_attention = True

    @property
    def current(self) -> StepRecord:
        return self.steps[-1]

    def _time_forwards(self, model: Iterable[torch.nn.Module]) -> None:
        """Time every forward of the stage module (not the data loading around it)."""
        started: list[float] = []

        def before(*_: Any) -> None:
            sync_device()
            started.append(time.perf_counter())

        def after(*_: Any) -> None:
            sync_device()
            self.current.forward_ms.append(1e3 * (time.perf_counter() - started.pop()))

        for chunk in model:
            while hasattr(chunk, "module"):  # DDP / Float16Module wrappers
                chunk = chunk.module
            self.masked_attention = not getattr(chunk, "use_te", False)
            chunk.register_forward_pre_hook(before)
            chunk.register_forward_hook(after)
            for tower in ("vit", "llm"):
                block = getattr(chunk, tower, None)
                for index, layer in enumerate(getattr(block, "layers", ())):
                    self._measure_layer(tower, index, layer)
        self._hooked = True

    def _measure_layer(self, tower: str, index: int, layer: torch.nn.Module) -> None:
        """The activations a layer stores per micro-batch (saved bytes while its forward runs),
        its input's bytes and its forward time; the re-run forward of recomputation (inside a
        backward) is not counted."""
        state: list[tuple[int, int, float]] = []

        def before(_: Any, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            size = hidden.untyped_storage().nbytes() if isinstance(hidden, torch.Tensor) else 0
            sync_device()
            state.append((self.tracker.bytes, size, time.perf_counter()))

        def after(*_: Any) -> None:
            sync_device()
            held, size, start = state.pop()
            if self._in_backward:
                return
            rows = self.current.layers.setdefault(tower, [])
            while len(rows) <= index:
                rows.append([0.0, 0.0, 0.0, 0.0])  # activation, input, total ms, forwards
            row = rows[index]
            row[0] = max(row[0], self.tracker.bytes - held)
            row[1] = max(row[1], size)
            ms = 1e3 * (time.perf_counter() - start)
            row[2] += ms
            row[3] += 1
            per_micro = self.current.tower_ms.setdefault(tower, [])
            micro = len(self.current.forward_ms)  # this micro-batch's forward is running
            per_micro.extend([0.0] * (micro + 1 - len(per_micro)))
            per_micro[micro] += ms

        layer.register_forward_pre_hook(before, with_kwargs=True)
        layer.register_forward_hook(after)

    def install(self) -> None:
        """Time megatron-core's backward step and wrap megatron.training's train_step."""
        from megatron.core.pipeline_parallel import schedules
        from megatron.training import training

        backward = timed(lambda ms: self.current.backward_ms.append(ms), schedules.backward_step)

        def measured_backward(*args: Any, **kwargs: Any) -> Any:
            self._in_backward = True
            try:
                return backward(*args, **kwargs)
            finally:
                self._in_backward = False
                self._schedule[1] = time.perf_counter()

        schedules.backward_step = measured_backward
        train_step = training.train_step

        def measured_train_step(forward_step_func: Any, data_iterator: Any, model: Any,
                                optimizer: Any, *args: Any, **kwargs: Any) -> Any:  # fmt: skip
            return self._step(train_step, forward_step_func, data_iterator, model, optimizer,
                              *args, **kwargs)  # fmt: skip

        training.train_step = measured_train_step

    def _time_forward_step(self, forward_step: Callable[..., Any]) -> Callable[..., Any]:
        """Megatron's forward step function, timed with the loss function it returns."""

        def run(*args: Any, **kwargs: Any) -> Any:
            record = self.current
            index = len(record.call_ms)
            if self._schedule[0] is None:
                self._schedule[0] = time.perf_counter()
            record.call_ms.append(0.0)
            output, loss = timed(lambda ms: _add(record.call_ms, index, ms), forward_step)(
                *args, **kwargs)  # fmt: skip
            return output, timed(lambda ms: _add(record.call_ms, index, ms), loss)

        return run

    def _step(self, train_step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        args = (self._time_forward_step(args[0]), *args[1:])
        model, optimizer = args[2], args[3]
        if not self._hooked:
            self._time_forwards(model)
        label = self.labels[len(self.steps)] if len(self.steps) < len(self.labels) else "extra"
        self.steps.append(StepRecord(label))
        self._schedule = [None, None]
        static = static_storages(model, optimizer)
        self.tracker.exclude = set(static)
        self.tracker.reset_peak()
        if self.gpu:
            torch.cuda.reset_peak_memory_stats()
        try:
            with self.tracker.hooks():
                out = timed(self._set_step_ms, train_step)(*args, **kwargs)
        except torch.OutOfMemoryError:
            from megatron.core import parallel_state

            from megatron_omnibal.megatron.runtime.stderr import write_line

            write_line(f"preflight: FAIL: pipeline stage "
                       f"{parallel_state.get_pipeline_model_parallel_rank()} ran out of device "
                       f"memory in its {label} step (step {len(self.steps) - 1})")  # fmt: skip
            raise
        # the optimizer's state exists after its first step: count it from then on
        parts = static_parts(model, optimizer)
        self.current.static_part_bytes = {k: sum(v.values()) for k, v in parts.items()}
        self.current.static_bytes = sum(self.current.static_part_bytes.values())
        self.current.activation_peak_bytes = self.tracker.peak
        start, end = self._schedule
        if start is not None and end is not None:
            self.current.schedule_ms = 1e3 * (end - start)
        for rows in self.current.layers.values():  # total ms and count -> ms per forward
            for row in rows:
                row[2:] = [row[2] / max(row[3], 1)]
        if self.gpu:
            self.current.allocator_peak_bytes = int(torch.cuda.max_memory_allocated())
        return out

    def _set_step_ms(self, ms: float) -> None:
        self.current.step_ms = ms

    def batch_features(self, tiles: int, sample_tokens: list[int]) -> list[int]:
        """[tiles, tokens, the sum of squared lengths the stage's attention runs over] of a
        micro-batch of `tiles` image tiles and samples of `sample_tokens` tokens."""
        tokens = sum(sample_tokens)
        squares = tokens**2 if self.masked_attention else sum(n * n for n in sample_tokens)
        return [tiles, tokens, squares]


def _add(values: list[float], index: int, ms: float) -> None:
    values[index] += ms
