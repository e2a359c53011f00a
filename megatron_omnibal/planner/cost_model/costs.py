"""Per-layer time and memory: an analytic FLOPs model or a measured layer profile.

The planner cuts [ViT layers, projector, LLM layers] into pipeline stages, so it needs, for each
of these units and a micro-batch's content, forward/backward/recompute time and memory. A
micro-batch is summarised by four features, `tiles`, `tokens`, `sumsq` (sum of squared sample
lengths: causal attention over packed variable-length sequences costs sum L^2, not (sum L)^2)
and 1; every analytic cost is linear in them, so one coefficient matrix serves any number of
micro-batches. Patch embedding rides with the first stage, the output head and loss with the
last (`first` / `last` extras); the LLM embedding and the merge of image embeddings ride with
the projector unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.cost_model.config_files import read_json
from megatron_omnibal.planner.cost_model.deepstack import deepstack_inbound
from megatron_omnibal.planner.cost_model.flops import ModelFlops
from megatron_omnibal.planner.cost_model.hardware import Hardware
from megatron_omnibal.planner.cost_model.memory import static_bytes_per_param
from megatron_omnibal.planner.cost_model.moe_costs import (
    ExpertLayout,
    alltoall_ms_per_token,
    layer_static_bytes,
    layer_sync_bytes,
    routed_values_per_token,
)

MIB = 2.0**20
GROUP_NONE, GROUP_VIT, GROUP_LLM = -1, 0, 1


@dataclass(frozen=True)
class Extra:
    """Work pinned to a stage (patch embedding on the first, head + loss on the last)."""

    forward_ms: np.ndarray | float = 0.0
    backward_ms: np.ndarray | float = 0.0
    activation_mib: np.ndarray | float = 0.0
    static_mib: float = 0.0


@dataclass(frozen=True)
class LayerCosts:
    """Costs of each partition unit for one micro-batch (arrays (U,)) or many ((U, M)).

    `checkpoint_mib` is what a fully recomputed layer still stores (its input); `group` says
    which recompute block a unit belongs to (Megatron recomputes the first k layers of a
    stage's block, per tower), -1 for units that are never recomputed.
    """

    names: tuple[str, ...]
    forward_ms: np.ndarray
    backward_ms: np.ndarray
    recompute_ms: np.ndarray
    activation_mib: np.ndarray
    checkpoint_mib: np.ndarray
    output_mib: np.ndarray
    static_mib: np.ndarray
    group: np.ndarray
    first: Extra = Extra()
    last: Extra = Extra()
    # MiB a stage starting at unit b receives besides the hidden state and holds per micro-batch
    # in flight (DeepStack features crossing boundary b); None: nothing
    inbound_mib: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.names)

    def inbound_at(self, lo: int) -> float | np.ndarray:
        """What a stage starting at unit `lo` receives and holds beside the hidden state."""
        if self.inbound_mib is None or lo == 0:
            return 0.0
        return self.inbound_mib[lo]


def workload_features(tiles: np.ndarray, tokens: np.ndarray, sumsq: np.ndarray) -> np.ndarray:
    """Micro-batch features (M, 4): tiles, tokens, sum of squared sample lengths, 1."""
    tiles = np.asarray(tiles, np.float64)
    return np.stack(
        [tiles, np.asarray(tokens, np.float64), np.asarray(sumsq, np.float64), np.ones_like(tiles)],
        axis=-1,
    )


@dataclass(frozen=True)
class CostModel:
    """Linear cost coefficients per unit: value = coef @ features."""

    names: tuple[str, ...]
    group: np.ndarray
    forward: np.ndarray  # (U, 4) ms
    backward: np.ndarray
    recompute: np.ndarray
    activation: np.ndarray  # (U, 4) MiB
    checkpoint: np.ndarray
    output: np.ndarray
    static_mib: np.ndarray  # (U,)
    first: np.ndarray  # (3, 4): forward, backward ms, activation MiB of the pinned work
    last: np.ndarray
    first_static_mib: float
    last_static_mib: float
    # per-step work outside the pipeline (optimizer step, the framework's per-step work), as a
    # calibrated profile measured it; the analytic model has none
    step_overhead_ms: float = 0.0
    # one transfer across a stage boundary as a profile measured it (its `p2p_ms`); None: the
    # hardware's latency plus the bytes over the pipeline link
    p2p_ms: float | None = None
    # static MiB (priced as static_mib is: static_bytes_per_param) of the parameters whose
    # gradients data parallelism reduces, per unit and of the pinned work; None: all of them.
    # A LoRA run reduces its adapters' gradients only (lora_costs.py)
    sync_mib: np.ndarray | None = None
    first_sync_mib: float | None = None
    last_sync_mib: float | None = None
    # (U, 4) MiB received across the boundary before each unit beside the hidden state
    # (DeepStack features in flight; LayerCosts.inbound_mib); None: nothing
    inbound: np.ndarray | None = None

    def sync(self) -> tuple[np.ndarray, float, float]:
        """(per unit, first, last) static MiB whose gradients DP reduces."""
        if self.sync_mib is None:
            return self.static_mib, self.first_static_mib, self.last_static_mib
        return self.sync_mib, float(self.first_sync_mib), float(self.last_sync_mib)

    def at(self, features: np.ndarray) -> LayerCosts:
        """Costs at one micro-batch (features (4,)) or many ((M, 4) -> arrays (U, M))."""
        f = np.asarray(features, np.float64).T
        first, last = self.first @ f, self.last @ f
        return LayerCosts(
            self.names,
            self.forward @ f,
            self.backward @ f,
            self.recompute @ f,
            self.activation @ f,
            self.checkpoint @ f,
            self.output @ f,
            self.static_mib,
            self.group,
            Extra(first[0], first[1], first[2], self.first_static_mib),
            Extra(last[0], last[1], last[2], self.last_static_mib),
            None if self.inbound is None else self.inbound @ f,
        )


def analytic_costs(
    model: ModelSpec,
    hw: Hardware,
    tp: int = 1,
    dp: int = 1,
    distributed_optimizer: bool = True,
    image_tiles: np.ndarray | None = None,
    ep: int = 1,
) -> CostModel:
    """FLOPs-based costs of every unit on `hw` with tensor parallel `tp` (sequence parallel on)
    and, for a mixture-of-experts LLM, expert parallel `ep` (moe_costs.py: expert weights and
    their optimizer state per GPU, the dispatcher's all-to-all, the routed tokens' activations).

    `image_tiles`, the tiles of each image of the data, prices a native-resolution ViT's
    attention (its family's vit_attention, models/families); its full-attention layers cost
    more than its windowed ones, so they are units of their own price.

    Time = FLOPs / (peak x efficiency x tp) + TP collectives + a per-layer launch overhead;
    backward is twice the forward FLOPs, recompute one more forward. Memory is BF16 weights,
    FP32 main gradients and FP32 Adam state (12 bytes/param, sharded over DP by the distributed
    optimizer), and per-micro-batch activations with flash attention, divided by tp.
    DeepStack features (Qwen3-VL) add to the transfers and the receiving stages' activations
    wherever they cross a stage boundary (deepstack.py).
    """
    if ep != 1 and not (model.llm.is_moe and dp % ep == 0 and model.llm.num_experts % ep == 0):
        raise ValueError(
            f"expert parallel {ep} needs a mixture-of-experts LLM whose {model.llm.num_experts} "
            f"experts and data-parallel size {dp} it divides"
        )
    rate = hw.peak_tflops * 1e12 * hw.efficiency * tp / 1e3  # FLOPs per ms per TP group
    tp_comm = 0.0 if tp == 1 else 4 * (tp - 1) / tp / (hw.nvlink_gbs * 1e9) * 1e3  # ms/byte
    bytes_per_param = static_bytes_per_param(dp if distributed_optimizer else 1)
    flops = ModelFlops.of(model, image_tiles)
    units = _UnitTable(tp, bytes_per_param)
    _add_vit_units(units, model, flops, rate, tp_comm, hw.op_overhead_ms, tp)
    layout = ExpertLayout(tp, ep, dp)
    _add_projector_and_llm_units(units, model, flops, rate, tp_comm, hw, layout,
                                 distributed_optimizer)  # fmt: skip
    fwd_a = np.array(units.fwd)
    comm = np.array(units.comm)  # sent once more in the backward, not twice
    bwd_a = 2 * (fwd_a - comm) + comm
    rec_a = np.where(np.array(units.group)[:, None] >= 0, fwd_a, 0.0)
    first, last = _pinned_costs(model, flops, rate, hw.op_overhead_ms, tp)
    embed_params = model.llm.vocab_size * model.llm.hidden_size
    inbound = deepstack_inbound(model, tp)
    out = np.array(units.out)
    if inbound is not None:  # the boundary after unit u carries what the one before u + 1 does
        out[:-1] += inbound[1:]
    static = np.array(units.static)
    first_static = model.patch_embed_params / tp * bytes_per_param / MIB
    last_static = embed_params / tp * bytes_per_param / MIB
    return CostModel(
        tuple(units.names),
        np.array(units.group),
        fwd_a,
        bwd_a,
        rec_a,
        np.array(units.act),
        np.array(units.ckpt),
        out,
        static,
        first,
        last,
        first_static,
        last_static,
        sync_mib=None if units.sync is None else np.array(units.sync),
        first_sync_mib=None if units.sync is None else first_static,
        last_sync_mib=None if units.sync is None else last_static,
        inbound=inbound,
    )


def _row(tiles: float = 0.0, tokens: float = 0.0, sumsq: float = 0.0, one: float = 0.0):
    """One cost's coefficients over the four micro-batch features."""
    return np.array([tiles, tokens, sumsq, one], np.float64)


class _UnitTable:
    """analytic_costs' per-unit rows, appended in model order."""

    def __init__(self, tp: int, bytes_per_param: float) -> None:
        self.tp, self.bytes_per_param = tp, bytes_per_param
        self.names: list[str] = []
        self.fwd: list[np.ndarray] = []
        self.act: list[np.ndarray] = []
        self.ckpt: list[np.ndarray] = []
        self.out: list[np.ndarray] = []
        self.static: list[float] = []
        self.group: list[int] = []
        self.comm: list[np.ndarray] = []  # the part of `fwd` that is expert all-to-all
        self.sync: list[float] | None = None  # set once a unit's gradient sync differs

    def add(self, name, f, a, c, o, params, g, comm=None, static_bytes=None,
            sync_bytes=None) -> None:  # fmt: skip
        """One unit; `static_bytes` / `sync_bytes` (a MoE layer's) replace the default pricing
        of `params` over TP."""
        default = params / self.tp * self.bytes_per_param
        self.names.append(name)
        self.fwd.append(f)
        self.act.append(a)
        self.ckpt.append(c)
        self.out.append(o)
        self.static.append((default if static_bytes is None else static_bytes) / MIB)
        self.group.append(g)
        self.comm.append(_row() if comm is None else comm)
        if sync_bytes is not None and self.sync is None:
            self.sync = list(self.static[:-1])
        if self.sync is not None:
            self.sync.append((self.static[-1] * MIB if sync_bytes is None else sync_bytes) / MIB)


def _add_vit_units(
    units: _UnitTable,
    model: ModelSpec,
    flops: ModelFlops,
    rate: float,
    tp_comm: float,
    over: float,
    tp: int,
) -> None:
    """The ViT layers: time per tile (a native tower's full-attention layers priced apart),
    activations with flash attention."""
    v = model.vit
    s = v.seq_per_tile
    vit_comm = s * 2 * v.hidden_size * tp_comm
    mlp_stored = (3 if v.gated_mlp else 2) * v.ffn_hidden_size
    vit_act = _row(tiles=s * 2 * (8 * v.hidden_size + mlp_stored) / tp / MIB)
    vit_ckpt = _row(tiles=s * 2 * v.hidden_size / tp / MIB)
    vit_out = _row(tiles=s * 2 * v.hidden_size / tp / MIB)
    for i in range(v.num_layers):
        vit_fwd = _row(
            tiles=flops.vit_layer(i, v.fullatt_block_indexes) / rate + vit_comm, one=over
        )
        units.add(f"vit.{i}", vit_fwd, vit_act, vit_ckpt, vit_out, v.layer_params, GROUP_VIT)


def _add_projector_and_llm_units(
    units: _UnitTable,
    model: ModelSpec,
    flops: ModelFlops,
    rate: float,
    tp_comm: float,
    hw: Hardware,
    layout: ExpertLayout,
    sharded: bool,
) -> None:
    """The projector unit (with the LLM embedding's weights and any DeepStack mergers) and the
    LLM layers (a MoE layer's experts as `layout` spreads them)."""
    llm, over, tp = model.llm, hw.op_overhead_ms, layout.tp
    mergers = 1 + len(model.vit.deepstack_indexes)
    n, pin, pmid, h = (
        model.tokens_per_tile,
        model.projector_in,
        model.projector_hidden,
        llm.hidden_size,
    )
    proj_fwd = _row(tiles=flops.projector_per_tile / rate, one=over)
    proj_act = _row(tiles=mergers * n * 2 * (2 * pin + 2 * pmid) / tp / MIB)
    llm_out = _row(tokens=2 * h / tp / MIB)
    a2a = _row(tokens=alltoall_ms_per_token(llm, hw, tp, layout.ep)) if llm.is_moe else _row()
    llm_fwd = a2a + _row(
        tokens=flops.llm_layer_per_token / rate + 2 * h * tp_comm,
        sumsq=flops.llm_layer_per_sumsq / rate,
        one=over,
    )
    # Per token: 4 h-wide tensors (the norms' inputs and outputs), q and the attention context
    # (heads x head size each), k and v, and the MLP's (a MoE's: moe_costs.py).
    q = llm.q_size
    mlp_stored = (routed_values_per_token(llm) if llm.is_moe
                  else (3 if llm.gated_mlp else 2) * llm.ffn_hidden_size)  # fmt: skip
    stored = 4 * h + 2 * q + 2 * llm.kv_size + mlp_stored
    llm_act = _row(tokens=2 * stored / tp / MIB)
    llm_ckpt = _row(tokens=2 * h / tp / MIB)
    embed_params = llm.vocab_size * h
    units.add(
        "projector",
        proj_fwd,
        proj_act,
        _row(),
        llm_out,
        model.projector_params + model.deepstack_merger_params + embed_params,
        GROUP_NONE,
    )
    moe = (
        {"comm": a2a, "static_bytes": layer_static_bytes(llm, layout, sharded),
         "sync_bytes": layer_sync_bytes(llm, layout)}
        if llm.is_moe else {}
    )  # fmt: skip
    for i in range(llm.num_layers):
        units.add(f"llm.{i}", llm_fwd, llm_act, llm_ckpt, llm_out, llm.layer_params, GROUP_LLM,
                  **moe)  # fmt: skip


def _pinned_costs(
    model: ModelSpec, flops: ModelFlops, rate: float, over: float, tp: int
) -> tuple[np.ndarray, np.ndarray]:
    """(first, last): forward, backward and activation rows of the patch embedding (first
    stage) and of the head with its loss (last stage)."""
    v, h, vocab = model.vit, model.llm.hidden_size, model.llm.vocab_size
    first = np.array(
        [
            _row(tiles=flops.patch_per_tile / rate, one=over),
            _row(tiles=2 * flops.patch_per_tile / rate),
            _row(tiles=v.num_patches * v.patch_dim * 2 / MIB),
        ]
    )
    head_fwd = _row(tokens=flops.head_per_token / rate, one=over)
    last = np.array([head_fwd, 2 * head_fwd, _row(tokens=(4 * h + 6 * vocab) / tp / MIB)])
    return first, last


def profile_cost_model(doc: dict, where: str = "profile", dp: int = 1) -> CostModel:
    """A CostModel from a measured layer profile, scaled from its measured micro-batch.

    A layer's `forward_ms` at the measured micro-batch (`measured`: its tiles, tokens and, with
    attention terms, `sumsq`) splits into `fixed_ms` (per micro-batch, whatever its size),
    `attention_ms` (growing with the sum of squared sample lengths) and the rest, which grows
    with tiles (ViT layers, projector) or tokens (LLM layers); backward and recompute split in
    the forward's proportions. Without those fields a layer is linear through the origin, its
    attention folded into the rate of the measured sequence. Static memory is re-derived for
    `dp` from each layer's `params` when present. Pinned work (patch embedding, head) is already
    folded into the first and last layers. A top-level `p2p_ms` replaces the hardware's
    point-to-point model.
    """
    costs, options = profile_from_dict(doc, where)
    measured = doc.get("measured")
    if not isinstance(measured, dict) or not all(
        isinstance(measured.get(k), int) and measured[k] > 0 for k in ("tiles", "tokens")
    ):
        raise ValueError(
            f"{where}: needs 'measured' with the positive integer 'tiles' and 'tokens' of the "
            "profiled micro-batch (written by `omnibal profile`) to scale to other batches"
        )
    attention, fixed = options["attention_ms"], options["fixed_ms"]
    sumsq = measured.get("sumsq")
    if np.any(attention > 0) and (
        isinstance(sumsq, bool) or not isinstance(sumsq, (int, float)) or not sumsq > 0
    ):
        raise ValueError(
            f"{where}: layers with 'attention_ms' need 'measured.sumsq', the positive sum of "
            f"squared sample lengths of the profiled micro-batch, got {sumsq!r}"
        )
    forward = np.asarray(costs.forward_ms, np.float64)
    over = np.flatnonzero(attention + fixed > forward * (1 + 1e-9) + 1e-12)
    if len(over):
        i = int(over[0])
        raise ValueError(
            f"{where}: layer {i} ('{costs.names[i]}'): 'attention_ms' + 'fixed_ms' "
            f"({attention[i] + fixed[i]}) exceed its 'forward_ms' ({forward[i]})"
        )
    group = np.asarray(costs.group)
    col = np.where(group == GROUP_LLM, 1, 0)
    size = np.where(group == GROUP_LLM, measured["tokens"], measured["tiles"]).astype(np.float64)
    timed = forward > 0  # a layer without forward time scales its backward linearly
    safe = np.where(timed, forward, 1.0)
    shares = np.zeros((len(costs), 4))  # each term's share of the forward, per feature
    rest = np.maximum(forward - attention - fixed, 0.0)  # never below 0 by rounding
    shares[np.arange(len(costs)), col] = np.where(timed, rest / safe, 1.0) / size
    if np.any(attention > 0):
        shares[:, 2] = np.where(timed, attention / safe, 0.0) / float(sumsq)
    shares[:, 3] = np.where(timed, fixed / safe, 0.0)
    if not np.any(forward[:, None] * shares[:, :3] > 0):
        _no_size_term(where, costs.names, forward, fixed)

    def scaled(values: np.ndarray) -> np.ndarray:
        return np.asarray(values, np.float64)[:, None] * shares

    params = [layer.get("params") for layer in doc["layers"]]
    if all(isinstance(p, int) for p in params):
        static = np.array(params, np.float64) * static_bytes_per_param(dp) / MIB
    else:
        static = np.asarray(costs.static_mib, np.float64)
    memory = np.zeros((len(costs), 4))  # memory grows with tiles or tokens alone
    memory[np.arange(len(costs)), col] = 1.0 / size

    def linear(values: np.ndarray) -> np.ndarray:
        return np.asarray(values, np.float64)[:, None] * memory

    zero = np.zeros((3, 4))
    return CostModel(
        costs.names,
        group,
        scaled(costs.forward_ms),
        scaled(costs.backward_ms),
        scaled(costs.recompute_ms),
        linear(costs.activation_mib),
        linear(costs.checkpoint_mib),
        linear(costs.output_mib),
        static,
        zero,
        zero,
        0.0,
        0.0,
        options.get("step_overhead_ms", 0.0),
        options.get("p2p_ms"),
    )


def _no_size_term(where: str, names: tuple[str, ...], forward: np.ndarray,
                  fixed: np.ndarray) -> None:  # fmt: skip
    """Raise for a profile none of whose time grows with a micro-batch's tiles or tokens: the
    balancer evens out modeled time per tile and token, and every pack would cost the same."""
    timed = np.flatnonzero(forward > 0)
    if len(timed) == 0:
        raise ValueError(f"{where}: every layer's 'forward_ms' is 0: no time to plan with")
    i = int(timed[0])
    raise ValueError(
        f"{where}: every layer's time is its 'fixed_ms' (the first, layer {i} ('{names[i]}'): "
        f"'fixed_ms' {fixed[i]} of 'forward_ms' {forward[i]}), so no time grows with a "
        "micro-batch's tiles or tokens and there is nothing to balance: give at least one "
        "layer a 'forward_ms' above its 'fixed_ms' + 'attention_ms'"
    )


PROFILE_GROUPS = {"vit": GROUP_VIT, "llm": GROUP_LLM, "none": GROUP_NONE}


def load_profile(path: str | Path) -> tuple[LayerCosts, dict]:
    """Read a layer profile (format: docs/planner.md); returns the costs and top-level options
    (with the layers' `attention_ms` and `fixed_ms` as arrays).

    Optional per-layer fields beyond the contract: `checkpoint_mib` (what a recomputed layer
    still stores, default 0), `output_mib` (tensor sent to the next stage, default 0), `group`
    ("vit"/"llm"/"none": recompute block, default one block for all layers), `attention_ms`
    and `fixed_ms` (parts of `forward_ms`, default 0: see profile_cost_model).
    """
    return profile_from_dict(read_json(path, "profile"), str(path))


def profile_from_dict(doc: dict, where: str = "profile") -> tuple[LayerCosts, dict]:
    """Validate a profile mapping; errors name the layer index and field."""
    if not isinstance(doc, dict) or not isinstance(doc.get("layers"), list) or not doc["layers"]:
        raise ValueError(f"{where}: expected an object with a non-empty 'layers' list")
    m = doc.get("micro_batches")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"{where}: 'micro_batches' must be a positive integer, got {m!r}")
    cols: dict[str, list[float]] = {
        k: []
        for k in (
            "forward_ms",
            "backward_ms",
            "recompute_ms",
            "activation_mib",
            "weight_mib",
            "checkpoint_mib",
            "output_mib",
            "attention_ms",
            "fixed_ms",
        )
    }
    names, groups = [], []
    for i, layer in enumerate(doc["layers"]):
        if not isinstance(layer, dict):
            raise ValueError(f"{where}: layer {i}: expected an object")
        names.append(str(layer.get("name", f"layer{i}")))
        for key in cols:
            value = layer.get(key)
            if value is None:
                if key in ("forward_ms", "backward_ms", "activation_mib", "weight_mib"):
                    raise ValueError(f"{where}: layer {i} ('{names[-1]}'): missing '{key}'")
                value = layer["forward_ms"] if key == "recompute_ms" else 0.0
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or value < 0
                or not np.isfinite(value)
            ):
                raise ValueError(
                    f"{where}: layer {i} ('{names[-1]}'): '{key}' must be a "
                    f"non-negative number, got {value!r}"
                )
            cols[key].append(float(value))
        group = layer.get("group", "vit")
        if group not in PROFILE_GROUPS:
            raise ValueError(
                f"{where}: layer {i}: 'group' must be one of "
                f"{', '.join(PROFILE_GROUPS)}, got {group!r}"
            )
        groups.append(PROFILE_GROUPS[group])
    options = {"micro_batches": m}
    for key in ("memory_budget_gib", "p2p_ms", "step_overhead_ms"):
        if key in doc:
            value = doc[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{where}: '{key}' must be a non-negative number, got {value!r}")
            options[key] = float(value)
    a = {k: np.array(v, np.float64) for k, v in cols.items()}
    options["attention_ms"], options["fixed_ms"] = a["attention_ms"], a["fixed_ms"]
    costs = LayerCosts(
        tuple(names),
        a["forward_ms"],
        a["backward_ms"],
        # Recomputation re-runs the layer's forward, so it costs at least that; a measured
        # difference (checkpointed minus plain fwd+bwd) can be ~0 in timing noise.
        np.maximum(a["recompute_ms"], a["forward_ms"]),
        a["activation_mib"],
        a["checkpoint_mib"],
        a["output_mib"],
        a["weight_mib"],
        np.array(groups),
    )
    return costs, options


def costs_to_profile(
    costs: LayerCosts,
    micro_batches: int,
    memory_budget_gib: float | None = None,
    p2p_ms: float | None = None,
) -> dict:
    """A layer profile (docs/planner.md) of single-micro-batch costs, extras in end units."""
    fwd = np.array(costs.forward_ms, np.float64)
    bwd = np.array(costs.backward_ms, np.float64)
    act = np.array(costs.activation_mib, np.float64)
    static = np.array(costs.static_mib, np.float64)
    for idx, extra in ((0, costs.first), (-1, costs.last)):
        fwd[idx] += float(extra.forward_ms)
        bwd[idx] += float(extra.backward_ms)
        act[idx] += float(extra.activation_mib)
        static[idx] += float(extra.static_mib)
    inverse = {v: k for k, v in PROFILE_GROUPS.items()}
    layers = [
        {
            "name": costs.names[i],
            "forward_ms": float(fwd[i]),
            "backward_ms": float(bwd[i]),
            "recompute_ms": float(costs.recompute_ms[i]),
            "activation_mib": float(act[i]),
            "weight_mib": float(static[i]),
            "checkpoint_mib": float(costs.checkpoint_mib[i]),
            "output_mib": float(costs.output_mib[i]),
            "group": inverse[int(costs.group[i])],
        }
        for i in range(len(costs))
    ]
    doc: dict = {"micro_batches": int(micro_batches), "layers": layers}
    if memory_budget_gib is not None:
        doc["memory_budget_gib"] = float(memory_budget_gib)
    if p2p_ms is not None:
        doc["p2p_ms"] = float(p2p_ms)
    return doc
