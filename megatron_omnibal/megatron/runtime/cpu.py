"""Run real Megatron-Core on a CPU-only torch with gloo.

Why: the tests, the demo and users' dry runs of a plan need megatron-core's real pipeline
schedules, transformer blocks, DDP and optimizer without a GPU. Megatron-Core assumes CUDA in
about 250 places (``device="cuda"`` factories, ``Tensor.cuda()``, ``torch.cuda.*`` streams,
events, RNG state). This module redirects those to the CPU and fixes the internals that go wrong
there. It is the ONLY place in the project that patches torch or Megatron; every patch names the
Megatron site it serves. It does nothing when CUDA is present.

A ``TorchFunctionMode`` would not reach code run inside ``autograd.backward`` (the recompute
forward of ``CheckpointFunction``), so the factory functions themselves are wrapped.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import os
import typing
from typing import Any

import torch

from megatron_omnibal.megatron.runtime.compat import ensure_typing_override

_ENABLED = False

# Tensor factories that Megatron calls with device="cuda" / torch.cuda.current_device():
# tensor_parallel/layers.py (weights), pipeline_parallel/p2p_communication.py (receive buffers),
# transformer/* (masks, rotary), distributed/param_and_grad_buffer.py (grad buffers),
# optimizer/* (found-inf flags, grad norms), parallel_state.py (global memory buffer).
_FACTORIES = (
    "empty",
    "zeros",
    "ones",
    "full",
    "rand",
    "randn",
    "randint",
    "randperm",
    "arange",
    "linspace",
    "eye",
    "tensor",
    "as_tensor",
    "empty_strided",
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
)


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_device(device: Any) -> Any:
    return torch.device("cpu") if _is_cuda_device(device) else device


def _wrap_factory(fn: Any) -> Any:
    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    factory.__omnibal_cpu__ = True  # type: ignore[attr-defined]
    return factory


def _map_to_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if "device" in kwargs:
        kwargs["device"] = _cpu_device(kwargs["device"])
    if args and _is_cuda_device(args[0]):
        args = (torch.device("cpu"), *args[1:])
    return args, kwargs


class _Stream:
    """CPU stand-in for torch.cuda.Stream: work is synchronous, so every wait is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, 0)


class _Event:
    """CPU stand-in for torch.cuda.Event (timers and overlap code record and wait on events)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        import time

        self._time = time.perf_counter
        self._t = 0.0

    def record(self, stream: Any = None) -> None:
        self._t = self._time()

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        return (end._t - self._t) * 1000.0


def _patch_torch() -> None:
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not getattr(fn, "__omnibal_cpu__", False):
            setattr(torch, name, _wrap_factory(fn))

    # Tensor.cuda(): pipeline_parallel/schedules.py, training/utils.py (loss reduction buffers).
    def tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.cuda = tensor_cuda  # type: ignore[method-assign]

    # Tensor.to(torch.cuda.current_device()) / .to("cuda"): optimizer/*, training/checkpointing.py.
    orig_to = torch.Tensor.to

    def tensor_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        args, kwargs = _map_to_args(args, kwargs)
        return orig_to(self, *args, **kwargs)

    torch.Tensor.to = tensor_to  # type: ignore[method-assign]

    # Tensor.new_empty(..., device=current_device()): the MoE all-to-all's receive buffer
    # (tensor_parallel/mappings.py) and the token dispatcher's.
    for name in ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"):
        method = getattr(torch.Tensor, name)
        if not getattr(method, "__omnibal_cpu__", False):
            setattr(torch.Tensor, name, _wrap_factory(method))

    # Tensor.pin_memory(): dist_checkpointing and offloading copy through pinned buffers.
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]

    # Module.cuda(): training/training.py get_model() moves the model with model_module.cuda().
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    orig_module_to = torch.nn.Module.to

    def module_to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        args, kwargs = _map_to_args(args, kwargs)
        return orig_module_to(self, *args, **kwargs)

    torch.nn.Module.to = module_to  # type: ignore[method-assign]

    cuda = torch.cuda
    # device="cuda"/current_device() sites all over core (tensor_parallel/layers.py, p2p).
    cuda.current_device = lambda: 0
    # training/initialize.py sets up model-parallel groups only when device_count() > 0.
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    # Synchronisation and cache control: training/training.py, timers.py, optimizer.
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    # Streams and events: distributed/param_and_grad_buffer.py, pipeline_parallel/*, timers.py.
    cuda.Stream = _Stream  # type: ignore[misc, assignment]
    cuda.Event = _Event  # type: ignore[misc, assignment]
    _default_stream = _Stream()
    cuda.current_stream = lambda *a, **k: _default_stream
    cuda.default_stream = lambda *a, **k: _default_stream
    cuda.stream = lambda *a, **k: contextlib.nullcontext()
    cuda.set_stream = lambda *a, **k: None
    cuda.is_current_stream_capturing = lambda: False
    # Memory reports: training/theoretical_memory_usage and report_memory in training/utils.py.
    for name in (
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "max_memory_reserved",
    ):
        setattr(cuda, name, lambda *a, **k: 0)
    cuda.memory_stats = lambda *a, **k: {}
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    # nvtx ranges: core/utils.py nvtx_range_push/pop around forward/backward steps.
    cuda.nvtx.range_push = lambda *a, **k: None
    cuda.nvtx.range_pop = lambda *a, **k: None
    cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    # CUDA RNG == the CPU generator, which is what dropout uses on CPU:
    # tensor_parallel/random.py CudaRNGStatesTracker.add / model_parallel_cuda_manual_seed.
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    # (torch.manual_seed itself calls cuda.manual_seed_all, so that one stays as it is.)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))


def _skip_disabled_compile() -> None:
    # megatron/core/jit.py sets jit_fuser = torch.compile, and importing megatron.core applies it
    # to the fused functions of core/fusions/*.py; the first call imports torch._dynamo and
    # torch._inductor (about 0.8 s of CPU in every worker process) only to hand each function
    # back unchanged when TORCHDYNAMO_DISABLE=1 (torch/_dynamo/eval_frame.py _optimize returns
    # _NullDecorator, which returns the function itself). Same result without those imports;
    # any other setting goes to torch.compile itself.
    compile_fn = torch.compile
    if getattr(compile_fn, "__omnibal_cpu__", False):
        return

    @functools.wraps(compile_fn)
    def compile_or_skip(model: Any = None, **kwargs: Any) -> Any:
        if os.environ.get("TORCHDYNAMO_DISABLE", "") != "1":
            return compile_fn(model, **kwargs)
        if model is None:  # used as @torch.compile(...)
            return _unchanged
        return _unchanged(model)

    compile_or_skip.__omnibal_cpu__ = True  # type: ignore[attr-defined]
    torch.compile = compile_or_skip  # type: ignore[assignment]


@contextlib.contextmanager
def _gc_paused() -> typing.Iterator[None]:
    """Python's cyclic collector off while megatron.core and megatron.training load: it would
    walk the growing heap of their modules, classes and dataclasses many times over and find
    next to nothing to free. Then one collection, and what is left (torch, Megatron: they live
    as long as the process) is frozen (gc.freeze), so that later collections (the imports and
    the training after this) do not walk it again. Together about 1.5 s less CPU per worker
    process. The collector's previous state is restored, and the frozen objects are handed back
    to the collector at exit, so that the interpreter's teardown frees them as before (else
    triton's bindings report them as leaked on every exit)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)
        if was_enabled:
            gc.enable()


def _unchanged(fn: Any) -> Any:
    if not callable(fn):  # what torch's _NullDecorator raises too
        raise AssertionError(f"A callable function is expected, but {type(fn)} is provided.")
    return fn


class _SameGeneratorFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    # tensor_parallel/random.py: _set_cuda_rng_state queues the set with torch.cuda._lazy_call,
    # which never runs on a CPU build, so CudaRNGStatesTracker.fork() and CheckpointFunction's
    # recompute silently use the wrong RNG stream (dropout masks differ -> wrong gradients).
    def get_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        state = torch.get_rng_state()
        return state.clone() if kwargs.get("clone") else state

    def set_cuda_rng_state(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(new_state)

    mp_random._get_cuda_rng_state = get_cuda_rng_state
    mp_random._set_cuda_rng_state = set_cuda_rng_state
    # CudaRNGStatesTracker.fork() warns when the CPU RNG moved inside a fork; on CPU the tracked
    # "cuda" stream IS the CPU generator, so every dropout would warn. Filter that one message.
    logging.getLogger(mp_random.__name__).addFilter(_SameGeneratorFilter())

    # models/vision/clip_vit_model.py: without TE its NORM_IMPL is torch.nn.LayerNorm, which
    # build_module calls with config=...; give it Megatron's own torch norm, which takes config.
    from megatron.core.models.vision import clip_vit_model
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if clip_vit_model.NORM_IMPL is torch.nn.LayerNorm:
        clip_vit_model.NORM_IMPL = WrappedTorchNorm
        defaults = list(clip_vit_model.CLIPViTModel.__init__.__defaults__ or ())
        clip_vit_model.CLIPViTModel.__init__.__defaults__ = tuple(
            WrappedTorchNorm if d is torch.nn.LayerNorm else d for d in defaults
        )

    _patch_moe_splits()
    _patch_uneven_first_dim_collectives()
    _patch_clip_grads()
    _patch_optimizer_param_types()
    _patch_write_results_queue()
    _patch_megatron_training()


def _patch_moe_splits() -> None:
    # transformer/moe/token_dispatcher.py: the all-to-all dispatcher moves its split sizes to
    # the host with maybe_move_tensor_to_cpu(..., as_numpy=True), which converts only CUDA
    # tensors; on the CPU they stayed tensors and all_to_all_single refused them as split sizes.
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "__omnibal_cpu__", False):
        return

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, **kwargs: Any) -> Any:
        if as_numpy and torch.is_tensor(tensor):
            return tensor.detach().numpy()
        return original(tensor, as_numpy=as_numpy, **kwargs)

    maybe_move_tensor_to_cpu.__omnibal_cpu__ = True  # type: ignore[attr-defined]
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_uneven_first_dim_collectives() -> None:
    # tensor_parallel/mappings.py: with split sizes (the MoE token dispatcher gathers its
    # tokens over the tensor-parallel ranks under sequence parallelism, each rank with its own
    # count) _gather_along_first_dim calls all_gather on a list of unequal tensors and
    # _reduce_scatter_along_first_dim reduce_scatter on one; gloo supports neither (it needs
    # equal sizes). On the CPU the gather pads every piece to the largest and trims, and the
    # reduce-scatter all-reduces the whole tensor and keeps this rank's rows: the same sums.
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    if getattr(gather, "__omnibal_cpu__", False):
        return

    def gather_along_first_dim(
        input_: torch.Tensor, group: Any, output_split_sizes: Any = None, *args: Any, **kw: Any
    ) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, *args, **kw)
        sizes = [int(n) for n in output_split_sizes]
        padded = input_.new_zeros(max(sizes), *input_.shape[1:])
        padded[: input_.shape[0]] = input_
        pieces = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(pieces, padded, group=group)
        return torch.cat([piece[:n] for piece, n in zip(pieces, sizes, strict=True)])

    def reduce_scatter_along_first_dim(
        input_: torch.Tensor, group: Any, input_split_sizes: Any = None, *args: Any, **kw: Any
    ) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, *args, **kw)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].clone()

    for fn in (gather_along_first_dim, reduce_scatter_along_first_dim):
        fn.__omnibal_cpu__ = True  # type: ignore[attr-defined]
    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def _patch_clip_grads() -> None:
    # megatron/core/optimizer/clip_grads.py clip_grad_by_total_norm_fp32 asserts
    # param.grad.type() == 'torch.cuda.FloatTensor', so `--clip-grad` > 0 failed on CPU
    # (MegatronOptimizer.clip_grad_norm / ChainedOptimizer.step in optimizer/optimizer.py,
    # models/mimo/optimizer.py). Same clipping with the assertion on the dtype only. The norm,
    # get_grad_norm_fp32, already runs on CPU: without TE/apex it uses core/utils.py's
    # local_multi_tensor_l2_norm and its device="cuda" buffers land on the CPU (factories above).
    import sys

    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.utils import to_local_if_dtensor

    if getattr(clip_grads.clip_grad_by_total_norm_fp32, "__omnibal_cpu__", False):
        return

    @torch.no_grad()
    def clip_grad_by_total_norm_fp32(
        parameters: Any, max_norm: float, total_norm: Any, use_decoupled_grad: bool = False
    ) -> None:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        dtypes = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
        grads = []
        for param in parameters:
            grad = getattr(param, attr, None)
            if grad is None:
                continue
            if grad.dtype not in dtypes:
                raise TypeError(
                    f"gradient clipping expects {attr} of dtype {dtypes}, got {grad.dtype} "
                    f"for a parameter of shape {tuple(param.shape)}"
                )
            grads.append(to_local_if_dtensor(grad).detach())
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if isinstance(clip_coeff, torch.Tensor):
            clip_coeff = clip_coeff.clamp_max(1.0)
        elif clip_coeff >= 1.0:
            return
        for grad in grads:
            grad.mul_(clip_coeff)

    clip_grad_by_total_norm_fp32.__omnibal_cpu__ = True  # type: ignore[attr-defined]
    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    optimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    mimo = sys.modules.get("megatron.core.models.mimo.optimizer")  # later imports read clip_grads
    if mimo is not None:
        mimo.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


# Tensor.type() names of the dtypes Megatron's optimizers sort parameters by, as on a GPU.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_type_names() -> typing.Iterator[None]:
    """While active, ``Tensor.type()`` names a CPU float tensor as its CUDA twin."""
    own = "type" in torch.Tensor.__dict__
    orig = torch.Tensor.type

    def tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu":
            name = _CUDA_TYPE_NAMES.get(self.dtype)
            if name is not None:
                return name
        return orig(self, *args, **kwargs)

    torch.Tensor.type = tensor_type  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own:
            torch.Tensor.type = orig  # type: ignore[method-assign]
        else:
            del torch.Tensor.type


def _patch_optimizer_param_types() -> None:
    # optimizer/optimizer.py Float16OptimizerWithFloat16Params.__init__ (--bf16, --fp16) and
    # optimizer/distrib_optimizer.py DistributedOptimizer.__init__ (its main_param loop and
    # _build_model_and_main_param_groups; --use-distributed-optimizer) sort parameters by
    # param.type() in 'torch.cuda.{Half,BFloat16,Float}Tensor' and raise TypeError for any
    # other, CPU tensors included. Their constructors run with CPU tensors named as CUDA ones;
    # everything after that compares dtypes, which are the same on both devices.
    from megatron.core.optimizer import distrib_optimizer, optimizer

    classes = (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer)
    for cls in classes:
        init = cls.__dict__["__init__"]
        if not getattr(init, "__omnibal_cpu__", False):
            cls.__init__ = _with_cuda_type_names(init)  # type: ignore[method-assign]

    # optimizer/distrib_optimizer.py load_parameter_state_from_dp_zero (resuming a
    # --use-distributed-optimizer --ckpt-format torch checkpoint): without apex/TE the optimizer
    # is torch's AdamW, whose per-parameter state holds a "step" tensor. The checkpoint keeps
    # "step" in param_groups only (load_state_dict restores it first), so
    # _set_main_param_and_optimizer_states looked up tensors["step"] and raised KeyError.
    # A non-tensor entry is what that method already skips. Its copy into fp32 main params
    # (views of the model params, which require grad) also needs no_grad, which
    # load_parameter_state_from_dp_zero lacks.
    cls = distrib_optimizer.DistributedOptimizer
    set_states = cls._set_main_param_and_optimizer_states
    if not getattr(set_states, "__omnibal_cpu__", False):

        @functools.wraps(set_states)
        def set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict) -> Any:
            with torch.no_grad():
                return set_states(self, model_param, {"step": None, **tensors})

        set_main_param_and_optimizer_states.__omnibal_cpu__ = True  # type: ignore[attr-defined]
        cls._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states

    # optimizer/distrib_optimizer.py DistributedOptimizer.load_state_dict ("Extract 'step', for
    # non-Apex/TE support") puts ONE step tensor into every parameter's state; torch's AdamW
    # adds 1 to it in place per parameter, so after a resume the bias correction used a step
    # count off by the number of parameters. Each parameter gets its own copy.
    load = cls.load_state_dict
    if not getattr(load, "__omnibal_cpu__", False):

        @functools.wraps(load)
        def load_state_dict(self: Any, state_dict: dict) -> None:
            load(self, state_dict)
            for state in self.optimizer.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"] = state["step"].clone()

        load_state_dict.__omnibal_cpu__ = True  # type: ignore[attr-defined]
        cls.load_state_dict = load_state_dict


def _patch_write_results_queue() -> None:
    # dist_checkpointing/strategies/filesystem_async.py: FileSystemWriterAsync (every torch_dist
    # save, a synchronous one too) makes its results queue with a multiprocessing Manager
    # started by "spawn", a fresh interpreter that re-imports the main module (the training
    # script: torch and Megatron again, about 4 CPU s per rank and run). Spawn keeps a CUDA
    # context out of the child; on a CPU there is none, and a forked Manager (what
    # training/async_utils.py asks for in its async worker) starts at no cost.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    orig = filesystem_async.get_write_results_queue
    if getattr(orig, "__omnibal_cpu__", False):
        return

    @functools.wraps(orig)
    def get_write_results_queue(mp_mode: str = "fork") -> Any:
        return orig(mp_mode)

    get_write_results_queue.__omnibal_cpu__ = True  # type: ignore[attr-defined]
    filesystem_async.get_write_results_queue = get_write_results_queue


def _with_cuda_type_names(init: Any) -> Any:
    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        with _cuda_type_names():
            init(self, *args, **kwargs)

    wrapped.__omnibal_cpu__ = True  # type: ignore[attr-defined]
    return wrapped


def _patch_megatron_training() -> None:
    # megatron/training/initialize.py initialize_megatron asserts torch.cuda.is_available()
    # unless allow_no_cuda=True; training/training.py pretrain() calls it without that flag.
    try:
        from megatron.training import initialize, training
    except ImportError:
        return
    orig = initialize.initialize_megatron
    if getattr(orig, "__omnibal_cpu__", False):
        return

    @functools.wraps(orig)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return orig(*args, **kwargs)

    initialize_megatron.__omnibal_cpu__ = True  # type: ignore[attr-defined]
    initialize.initialize_megatron = initialize_megatron
    training.initialize_megatron = initialize_megatron
    _read_field_docs_once()

    # training/arguments.py validate_args calls utils/common_utils.py get_device_arch_version()
    # (torch.cuda.get_device_properties) when TP or CP > 1: no CUDA arch on a CPU (0, as on a
    # pre-Blackwell GPU). It then requires CUDA_DEVICE_MAX_CONNECTIONS=1, which orders kernels
    # on a GPU and means nothing here, so it is set unless the user set it.
    from megatron.training import arguments
    from megatron.training import utils as training_utils
    from megatron.training.utils import common_utils

    def get_device_arch_version() -> int:
        return 0

    arguments.get_device_arch_version = get_device_arch_version
    common_utils.get_device_arch_version = get_device_arch_version
    training_utils.get_device_arch_version = get_device_arch_version
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _read_field_docs_once() -> None:
    # training/argument_utils.py ArgumentGroupFactory takes each config dataclass's help texts
    # from its source (inspect.getsource parses the class's whole module), and a training
    # process builds Megatron's parser three times (pretrain_vlm's check, arguments.py
    # parse_args, ft_integration.setup's parse_args): about 1 CPU s of each rank's start on
    # this CPU. A class's source does not change while it runs: read once, a copy handed out.
    from megatron.training.argument_utils import ArgumentGroupFactory

    read = ArgumentGroupFactory._get_field_docstrings
    if getattr(read, "__omnibal_cpu__", False):
        return
    cache: dict[type, dict[str, str]] = {}

    @functools.wraps(read)
    def get_field_docstrings(self: Any, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in cache:
            cache[src_cfg_class] = read(self, src_cfg_class)
        return dict(cache[src_cfg_class])

    get_field_docstrings.__omnibal_cpu__ = True  # type: ignore[attr-defined]
    ArgumentGroupFactory._get_field_docstrings = get_field_docstrings  # type: ignore[method-assign]


def enable_cpu_megatron() -> bool:
    """Make megatron-core run on this CPU-only torch; True if the patches are (now) active.

    Call before building models or process groups. Idempotent. Returns False and changes
    nothing when CUDA is available.
    """
    global _ENABLED
    if _ENABLED:
        return True
    if torch.cuda.is_available():
        return False
    ensure_typing_override()  # megatron.training on Python 3.11 (compat.py)
    _patch_torch()
    _skip_disabled_compile()  # before megatron.core is imported (_patch_megatron)
    with _gc_paused():
        _patch_megatron()
    _ENABLED = True
    return True


def cpu_megatron_enabled() -> bool:
    """Whether enable_cpu_megatron() has patched this process."""
    return _ENABLED


__all__ = ["enable_cpu_megatron", "cpu_megatron_enabled"]
