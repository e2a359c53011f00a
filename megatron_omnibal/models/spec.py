"""One model spec for the whole project: every architectural fact the planner, the Megatron stage
module and the Hugging Face converters need about a vision-language model.

Why one type: the planner prices the same layers the Megatron side builds, and a checkpoint
converted from Hugging Face must land in exactly the modules the spec describes. A spec is
frozen, validated when built, and round-trips through a JSON dict (plan.json's `model_spec`);
unknown or missing keys are errors that name the key.

Model order is [patch embedding, ViT layers, projector, LLM embedding, LLM layers, head]. The
ViT's `num_layers` counts the layers the model runs: with LLaVA's `vision_feature_layer=-2` the
checkpoint's last layer is never used, so the spec does not build or price it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu", "silu", "relu")
PROJECTORS = ("pixel_shuffle_mlp", "mlp", "patch_merger")
FOLDING_PROJECTORS = ("pixel_shuffle_mlp", "patch_merger")  # fold factor^2 patches into one


class SpecError(ValueError):
    """A model spec that cannot describe a buildable model; the message names the field."""


def _need(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise SpecError(f"{where}: {msg}")


def _check_positive(obj: Any, where: str, names: tuple[str, ...]) -> None:
    for n in names:
        v = getattr(obj, n)
        _need(
            isinstance(v, int) and not isinstance(v, bool) and v > 0,
            f"{where}.{n}",
            f"expected a positive integer, got {v!r}",
        )


def _check_choice(value: str, where: str, choices: tuple[str, ...]) -> None:
    _need(value in choices, where, f"{value!r} is not one of {', '.join(choices)}")


def _check_eps(value: float, where: str) -> None:
    _need(
        isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 1,
        where,
        f"expected a small positive number, got {value!r}",
    )


def missing_fields(
    fields: dict[str, dataclasses.Field], given: Iterable[str], optional: tuple[str, ...] = ()
) -> list[str]:
    """The dataclass fields without a default that `given` lacks (`optional` aside)."""
    return [
        n
        for n, f in fields.items()
        if n not in given
        and n not in optional
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]


def _check_tower(tower: Any, where: str, positive: tuple[str, ...]) -> None:
    """What both towers check alike: their shape numbers (and `positive`) > 0, norm, activation
    and norm epsilon."""
    shape = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")
    _check_positive(tower, where, shape + positive)
    _check_choice(tower.norm, f"{where}.norm", NORMS)
    _check_choice(tower.activation, f"{where}.activation", ACTIVATIONS)
    _check_eps(tower.norm_eps, f"{where}.norm_eps")


@dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """The ViT: each layer sees one tile as `patches (+ class token)` tokens; tiles are the batch.

    Covers InternViT (RMSNorm or LayerNorm, optional qkv bias, layer scale, QK-norm over all
    heads at once), CLIP (pre-LayerNorm, quick_gelu, no patch-embedding bias) and Qwen2.5-VL's
    native-resolution tower (`native_resolution`): images keep their own size (a multiple of
    `patch_size x spatial_merge_size` pixels per side), so the unit of vision work, the "tile",
    is one merge group of `spatial_merge_size`^2 patches (`image_size` = 28 px, one LLM token);
    attention runs within windows of `window_size` pixels except in the layers
    `fullatt_block_indexes`, which attend over the whole image; 2D rotary positions (base
    `rope_theta`) instead of a learned table; a SwiGLU MLP (`gated_mlp`) with biases; each patch
    is `temporal_patch_size` frames deep (a still image repeated), `patch_dim` values.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    norm: str = "layernorm"
    norm_eps: float = 1e-6
    activation: str = "gelu"
    qkv_bias: bool = True
    # RMSNorm of the whole projected q (and k) vector across all heads (InternViT-6B), not
    # megatron-core's per-head qk_layernorm.
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    layer_scale: bool = False  # residual branches scaled by learned per-channel vectors
    class_token: bool = True
    patch_bias: bool = True  # bias of the patch-embedding convolution (CLIP has none)
    pre_norm: bool = False  # LayerNorm after the embeddings, before layer 0 (CLIP)
    post_norm: bool = False  # LayerNorm after the last used layer (InternVL, no mean pooling)
    drop_class_token: bool = True  # the projector sees patches only ("default" feature select)
    gated_mlp: bool = False  # SwiGLU MLP (gate, up, down; biased), Qwen2.5-VL
    native_resolution: bool = False  # images at their own size; a tile is one merge group
    temporal_patch_size: int = 1  # frames per patch (Qwen2.5-VL: 2, a still image doubled)
    spatial_merge_size: int = 1  # patches merged per side into one LLM token
    window_size: int = 0  # pixels per window side of the windowed layers (0: no windows)
    fullatt_block_indexes: tuple[int, ...] = ()  # layers attending over the whole image
    rope_theta: float = 10000.0  # base of a native-resolution tower's 2D rotary positions
    tokens_per_second: float = 2.0  # M-RoPE time positions per second of video (Qwen2.5-VL)
    # A learned table of a square grid of positions (Qwen3-VL: 2304 = 48 x 48), interpolated
    # bilinearly to each image's patch grid and added to the patch embeddings; 0: none.
    num_position_embeddings: int = 0
    # DeepStack (Qwen3-VL): the hidden states after these ViT layers each pass their own merger
    # and are added to the LLM hidden states at the visual positions after LLM layers 0, 1, ...
    # (the i-th lowest index feeds LLM layer i, through the merger of its place in this list).
    deepstack_indexes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        w = "model_spec.vit"
        object.__setattr__(self, "fullatt_block_indexes", tuple(self.fullatt_block_indexes))
        object.__setattr__(self, "deepstack_indexes", tuple(self.deepstack_indexes))
        _check_tower(self, w, ("image_size", "patch_size"))
        _check_eps(self.qk_norm_eps, f"{w}.qk_norm_eps")
        _need(
            self.hidden_size % self.num_attention_heads == 0,
            f"{w}.hidden_size",
            f"{self.hidden_size} is not a multiple of the {self.num_attention_heads} heads",
        )
        _need(
            self.image_size % self.patch_size == 0,
            f"{w}.image_size",
            f"{self.image_size} is not a multiple of patch_size {self.patch_size}",
        )
        _check_positive(self, w, ("temporal_patch_size", "spatial_merge_size"))
        full = self.fullatt_block_indexes
        _need(
            all(isinstance(i, int) and 0 <= i < self.num_layers for i in full)
            and list(full) == sorted(set(full)),
            f"{w}.fullatt_block_indexes",
            f"{list(full)} must be ascending layer indexes below num_layers {self.num_layers}",
        )
        cell = self.patch_size * self.spatial_merge_size
        _need(
            isinstance(self.window_size, int) and self.window_size >= 0
            and self.window_size % cell == 0,
            f"{w}.window_size",
            f"{self.window_size} is not 0 or a multiple of patch_size x spatial_merge_size "
            f"= {cell}",
        )
        if self.native_resolution:
            _need(
                self.image_size == cell,
                f"{w}.image_size",
                f"{self.image_size}: a native-resolution tile is one merge group of {cell} px",
            )
            _need(not self.class_token, f"{w}.class_token", "a native-resolution ViT has none")
            _need(self.rope_theta > 0, f"{w}.rope_theta", f"must be > 0, got {self.rope_theta}")
        side = math.isqrt(max(self.num_position_embeddings, 0))
        _need(
            isinstance(self.num_position_embeddings, int) and self.num_position_embeddings >= 0
            and side * side == self.num_position_embeddings
            and (self.num_position_embeddings == 0 or self.native_resolution),
            f"{w}.num_position_embeddings",
            f"{self.num_position_embeddings} is not 0 or the square table of a native-resolution "
            "tower",
        )
        deep = self.deepstack_indexes
        _need(
            all(isinstance(i, int) and 0 <= i < self.num_layers for i in deep)
            and len(set(deep)) == len(deep) and (not deep or self.native_resolution),
            f"{w}.deepstack_indexes",
            f"{list(deep)} must be distinct layer indexes below num_layers {self.num_layers} of "
            "a native-resolution tower",
        )

    @property
    def position_table_side(self) -> int:
        """Positions per side of the learned table (0: none)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def windowed(self) -> bool:
        """Whether the layers outside `fullatt_block_indexes` attend within windows."""
        return self.window_size > 0

    @property
    def window_patches(self) -> int:
        """Patches per side of a full window (Qwen2.5-VL: 112 px / 14 = 8)."""
        return self.window_size // self.patch_size

    @property
    def window_units(self) -> int:
        """Merge groups per side of a full window (Qwen2.5-VL: 112 px / 28 = 4; 0: none)."""
        return self.window_size // (self.patch_size * self.spatial_merge_size)

    @property
    def patch_dim(self) -> int:
        """Values per patch the patch embedding reads: channels x frames x pixels."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    @property
    def grid(self) -> int:
        """Patches per tile side."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid**2

    @property
    def seq_per_tile(self) -> int:
        """Tokens every ViT layer sees per tile."""
        return self.num_patches + int(self.class_token)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def layer_params(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        mlp = (3 if self.gated_mlp else 2) * h * f + (2 if self.gated_mlp else 1) * f + h
        biases = (3 * h if self.qkv_bias else 0) + h
        norms = (2 if self.norm == "rmsnorm" else 4) * h  # two norms: weight (and bias)
        norms += (2 * h if self.qk_norm else 0) + (2 * h if self.layer_scale else 0)
        return 4 * h * h + mlp + biases + norms


@dataclass(frozen=True, kw_only=True)
class ProjectorSpec:
    """Vision-to-language bridge: optional pixel shuffle + LayerNorm, then a two-layer MLP.

    `patch_merger` (Qwen2.5-VL, Qwen3-VL): a norm of each patch (`merger_norm`), the patches of
    each merge group concatenated (the same fold as the pixel shuffle, by `factor` per side),
    then the MLP. Qwen3-VL's DeepStack mergers have the same MLP with a LayerNorm over the
    concatenated group instead (see ModelSpec.deepstack_merger_params).
    """

    type: str = "pixel_shuffle_mlp"
    downsample: float = 0.5  # pixel shuffle keeps 1/downsample^2 of the tokens, 4x channels
    hidden_size: int = 0  # MLP width; 0: the LLM's hidden size (InternVL, LLaVA)
    norm_eps: float = 1e-5  # the pixel-shuffle projector's LayerNorm
    activation: str = "gelu"
    bias: bool = True  # biases of the two linear layers (LLaVA's multimodal_projector_bias)
    # Token order of the pixel shuffle: 2 is transformers' InternVL (and OpenGVLab's
    # ps_version v2); 1 is ps_version v1 (InternVL-Chat-V1-5), which leaves the grid transposed.
    shuffle_version: int = 2
    # The patch merger's per-patch norm: Qwen2.5-VL's RMSNorm or Qwen3-VL's LayerNorm.
    merger_norm: str = "rmsnorm"

    def __post_init__(self) -> None:
        w = "model_spec.projector"
        _check_choice(self.type, f"{w}.type", PROJECTORS)
        _check_choice(self.merger_norm, f"{w}.merger_norm", NORMS)
        _need(
            self.shuffle_version in (1, 2),
            f"{w}.shuffle_version",
            f"expected 1 or 2, got {self.shuffle_version!r}",
        )
        _check_choice(self.activation, f"{w}.activation", ACTIVATIONS)
        _check_eps(self.norm_eps, f"{w}.norm_eps")
        _need(
            isinstance(self.hidden_size, int) and self.hidden_size >= 0,
            f"{w}.hidden_size",
            f"expected an integer >= 0, got {self.hidden_size!r}",
        )
        if self.type in FOLDING_PROJECTORS:
            factor = round(1 / self.downsample) if self.downsample > 0 else 0
            _need(
                factor >= 1 and abs(factor * self.downsample - 1) < 1e-6,
                f"{w}.downsample",
                f"{self.downsample} must be 1/k for an integer k",
            )

    @property
    def factor(self) -> int:
        """Patches folded per side by the pixel shuffle (1: none)."""
        return round(1 / self.downsample) if self.type in FOLDING_PROJECTORS else 1


@dataclass(frozen=True, kw_only=True)
class LanguageSpec:
    """A decoder-only LLM (Llama 2/3, Qwen2/2.5/3, InternLM2, Mistral, Vicuna): RoPE (optionally
    with Llama-3 scaling), grouped-query attention, optional per-head QK-norm (Qwen3), gated
    (SwiGLU) or plain MLP."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    vocab_size: int
    num_query_groups: int = 0  # KV heads; 0: as many as attention heads (MHA)
    kv_channels: int = 0  # head dimension; 0: hidden_size / num_attention_heads
    norm: str = "rmsnorm"
    norm_eps: float = 1e-6
    activation: str = "silu"
    gated_mlp: bool = True
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3), one weight per dim
    rotary_base: float = 10000.0
    # Llama-3 RoPE scaling factor (0: none); its low/high frequency factors 1 and 4 and original
    # context 8192 are megatron-core's fixed values, checked when a checkpoint is read.
    rope_scaling_factor: float = 0.0
    max_position_embeddings: int = 32768
    tie_embeddings: bool = False  # the output head reuses the input embedding
    # Multimodal RoPE (Qwen2.5-VL): rotary frequency pairs given to the (t, h, w) position axes,
    # summing to half the head dimension; () is plain 1D RoPE.
    mrope_section: tuple[int, ...] = ()
    # Qwen3-VL's interleaved M-RoPE: frequency pair j goes to the height axis when j % 3 == 1
    # and j < 3 x section[1], to the width axis when j % 3 == 2 and j < 3 x section[2], else
    # to time; False: Qwen2.5-VL's contiguous sections.
    mrope_interleaved: bool = False
    # Mixture of experts in every layer's MLP (Qwen3-MoE): 0 experts is a dense MLP. A router
    # picks `moe_top_k` of `num_experts` experts of width `moe_ffn_hidden_size` per token;
    # `moe_norm_topk_prob` renormalises the picked probabilities; the router's load-balancing
    # loss is scaled by `moe_aux_loss_coeff` (0: none).
    num_experts: int = 0
    moe_top_k: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True
    moe_aux_loss_coeff: float = 0.0

    def __post_init__(self) -> None:
        w = "model_spec.llm"
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if self.num_query_groups == 0:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.kv_channels == 0 and self.num_attention_heads > 0:
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        _check_tower(
            self, w, ("vocab_size", "num_query_groups", "kv_channels", "max_position_embeddings")
        )
        _need(
            self.num_attention_heads % self.num_query_groups == 0,
            f"{w}.num_query_groups",
            f"{self.num_query_groups} does not divide the {self.num_attention_heads} heads",
        )
        _need(self.rotary_base > 0, f"{w}.rotary_base", f"must be > 0, got {self.rotary_base}")
        _need(
            self.rope_scaling_factor == 0 or self.rope_scaling_factor >= 1,
            f"{w}.rope_scaling_factor",
            f"must be 0 (no scaling) or >= 1, got {self.rope_scaling_factor}",
        )
        section = self.mrope_section
        _need(
            not section or (
                len(section) == 3 and all(isinstance(x, int) and x > 0 for x in section)
                and 2 * sum(section) == self.kv_channels
            ),
            f"{w}.mrope_section",
            f"{list(section)} must be 3 positive integers summing to half the head dimension "
            f"{self.kv_channels}",
        )
        _need(
            not self.mrope_interleaved or (
                section and 3 * section[1] <= self.kv_channels // 2
                and 3 * section[2] <= self.kv_channels // 2
            ),
            f"{w}.mrope_interleaved",
            f"needs an mrope_section whose height and width sections fit every third of the "
            f"{self.kv_channels // 2} frequency pairs, got {list(section)}",
        )
        self._check_moe(w)

    def _check_moe(self, w: str) -> None:
        e, k, f = self.num_experts, self.moe_top_k, self.moe_ffn_hidden_size
        for key, value in (("num_experts", e), ("moe_top_k", k), ("moe_ffn_hidden_size", f)):
            _need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                f"{w}.{key}",
                f"expected an integer >= 0, got {value!r}",
            )
        if e == 0:
            _need(k == 0 and f == 0, f"{w}.num_experts",
                  "0 (a dense MLP), yet moe_top_k or moe_ffn_hidden_size is set")  # fmt: skip
            return
        _need(1 <= k <= e, f"{w}.moe_top_k", f"{k} must be between 1 and num_experts {e}")
        _need(f > 0, f"{w}.moe_ffn_hidden_size", "a mixture of experts needs the experts' width")
        _need(
            isinstance(self.moe_aux_loss_coeff, (int, float)) and self.moe_aux_loss_coeff >= 0,
            f"{w}.moe_aux_loss_coeff",
            f"expected a number >= 0, got {self.moe_aux_loss_coeff!r}",
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_params(self) -> int:
        """Parameters of one expert (a gated or plain MLP of `moe_ffn_hidden_size`)."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * self.moe_ffn_hidden_size

    @property
    def kv_size(self) -> int:
        """Width of K (and of V): KV heads x head dimension."""
        return self.kv_channels * self.num_query_groups

    @property
    def q_size(self) -> int:
        return self.kv_channels * self.num_attention_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one layer, every expert counted (a MoE layer's router included)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        mlp = (3 if self.gated_mlp else 2) * h * f
        if self.is_moe:
            mlp = self.num_experts * self.expert_params + h * self.num_experts
        attn = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        bias = self.q_size + 2 * self.kv_size if self.qkv_bias else 0
        qk_norm = 2 * self.kv_channels if self.qk_norm else 0
        return attn + bias + qk_norm + mlp + 2 * h


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A vision-language model: [patch embedding, ViT layers, projector, LLM layers, head].

    `tokens_per_tile` (0: derived) is what one real tile becomes in the LLM sequence;
    `image_token_id` is the placeholder id those tokens carry (-1: the last vocabulary id).
    InternVL wraps each image's placeholders in `image_start_id` / `image_end_id` (-1: none).
    """

    name: str = field(compare=False)  # two specs of one architecture are equal whatever named
    vit: VisionSpec
    projector: ProjectorSpec
    llm: LanguageSpec
    tokens_per_tile: int = 0
    image_token_id: int = -1
    image_start_id: int = -1
    image_end_id: int = -1
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        v, p = self.vit, self.projector
        _need(
            not v.native_resolution or (
                p.type == "patch_merger" and p.factor == v.spatial_merge_size
            ),
            "model_spec.projector",
            f"a native-resolution ViT needs a patch_merger projector folding "
            f"{v.spatial_merge_size} patches per side, got {p.type} by {p.factor}",
        )
        _need(
            v.grid % p.factor == 0,
            "model_spec.projector.downsample",
            f"a {v.grid}x{v.grid} patch grid cannot be pixel-shuffled by {p.factor}",
        )
        derived = (v.grid // p.factor) ** 2
        if not v.drop_class_token and v.class_token:
            _need(
                p.type == "mlp",
                "model_spec.vit.drop_class_token",
                "a pixel-shuffle projector needs the class token dropped",
            )
            derived += 1
        if self.tokens_per_tile == 0:
            object.__setattr__(self, "tokens_per_tile", derived)
        _need(
            self.tokens_per_tile == derived,
            "model_spec.tokens_per_tile",
            f"{self.tokens_per_tile}, but a {v.image_size}px tile with patch {v.patch_size} and "
            f"projector {p.type} gives {derived}",
        )
        if self.image_token_id < 0:
            object.__setattr__(self, "image_token_id", self.llm.vocab_size - 1)
        for key in ("image_token_id", "image_start_id", "image_end_id"):
            value = getattr(self, key)
            _need(
                value == -1 or 0 <= value < self.llm.vocab_size,
                f"model_spec.{key}",
                f"{value} is outside the vocabulary of {self.llm.vocab_size}",
            )
        if p.hidden_size == 0:
            object.__setattr__(self, "projector", replace(p, hidden_size=self.llm.hidden_size))
        _need(
            len(v.deepstack_indexes) <= self.llm.num_layers,
            "model_spec.vit.deepstack_indexes",
            f"{len(v.deepstack_indexes)} DeepStack taps, but the LLM has only "
            f"{self.llm.num_layers} layers to add them after",
        )

    # Sizes the planner prices.
    @property
    def projector_in(self) -> int:
        """Width entering the projector MLP (pixel shuffle folds patches into channels)."""
        return self.vit.hidden_size * self.projector.factor**2

    @property
    def projector_hidden(self) -> int:
        return self.projector.hidden_size

    @property
    def projector_params(self) -> int:
        i, m, o = self.projector_in, self.projector_hidden, self.llm.hidden_size
        merger_norm = (2 if self.projector.merger_norm == "layernorm" else 1) * self.vit.hidden_size
        norm = {"pixel_shuffle_mlp": 2 * i, "patch_merger": merger_norm}.get(self.projector.type, 0)
        return i * m + m * o + (m + o if self.projector.bias else 0) + norm

    @property
    def deepstack_merger_params(self) -> int:
        """Parameters of all DeepStack mergers: each a LayerNorm over the merge group's
        concatenated patches, then the projector's MLP."""
        i, m, o = self.projector_in, self.projector_hidden, self.llm.hidden_size
        one = i * m + m * o + (m + o if self.projector.bias else 0) + 2 * i
        return one * len(self.vit.deepstack_indexes)

    @property
    def patch_embed_params(self) -> int:
        v = self.vit
        conv = v.patch_dim * v.hidden_size + (v.hidden_size if v.patch_bias else 0)
        if v.native_resolution:  # 2D rotary positions (and Qwen3-VL's interpolated table)
            return conv + v.num_position_embeddings * v.hidden_size
        return conv + (v.seq_per_tile + int(v.class_token)) * v.hidden_size

    @property
    def tokens_per_image(self) -> int:
        """Sequence tokens of a one-tile image, the start/end markers included."""
        return self.tokens_per_tile + (self.image_start_id >= 0) + (self.image_end_id >= 0)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (plan.json's `model_spec`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Any, where: str = "model_spec") -> ModelSpec:
        """A spec from its JSON form; unknown, missing or mistyped keys name themselves."""
        if not isinstance(doc, dict):
            raise SpecError(f"{where}: expected a mapping, got {type(doc).__name__}")
        parts = {"vit": VisionSpec, "projector": ProjectorSpec, "llm": LanguageSpec}
        top = {k: v for k, v in doc.items() if k not in parts}
        kwargs = _fields(cls, top, where, skip=tuple(parts))
        for key, kind in parts.items():
            if key not in doc:
                if key == "projector":
                    kwargs[key] = ProjectorSpec()
                    continue
                raise SpecError(f"{where}: missing section '{key}'")
            kwargs[key] = kind(**_fields(kind, doc[key], f"{where}.{key}"))
        kwargs.setdefault("name", "model")
        return cls(**kwargs)


def check_expert_parallel(spec: ModelSpec, ep: int) -> None:
    """Raise ValueError naming the sizes that work unless `ep` splits the LLM's experts (EP
    > 1 needs a mixture-of-experts LLM)."""
    llm = spec.llm
    if ep == 1:
        return
    if not llm.is_moe:
        raise ValueError(
            f"expert parallel size {ep}: the LLM has no experts (llm.num_experts is 0); "
            "expert parallelism needs a mixture-of-experts LLM"
        )
    if ep < 1 or llm.num_experts % ep:
        sizes = [e for e in range(1, llm.num_experts + 1) if llm.num_experts % e == 0]
        raise ValueError(
            f"expert parallel size {ep} does not divide the LLM's {llm.num_experts} experts "
            f"(llm.num_experts); sizes that work: {', '.join(map(str, sizes))}"
        )


def _fields(cls: type, doc: Any, where: str, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """Check `doc` against the fields of dataclass `cls`: names and basic types."""
    if not isinstance(doc, dict):
        raise SpecError(f"{where}: expected a mapping, got {type(doc).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls) if f.name not in skip}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key not in known:
            raise SpecError(f"{where}: unknown field '{key}' (known: {', '.join(known)})")
        kind = known[key].type
        if kind == "bool":
            _need(isinstance(value, bool), f"{where}.{key}", f"expected true/false, got {value!r}")
        elif kind == "int":
            _need(
                isinstance(value, int) and not isinstance(value, bool),
                f"{where}.{key}",
                f"expected an integer, got {value!r}",
            )
        elif kind == "float":
            _need(
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value),
                f"{where}.{key}",
                f"expected a number, got {value!r}",
            )
            value = float(value)
        elif kind == "str":
            _need(isinstance(value, str), f"{where}.{key}", f"expected a string, got {value!r}")
        elif kind == "tuple[int, ...]":
            _need(
                isinstance(value, (list, tuple))
                and all(isinstance(x, int) and not isinstance(x, bool) for x in value),
                f"{where}.{key}",
                f"expected a list of integers, got {value!r}",
            )
            value = tuple(value)
        out[key] = value
    missing = missing_fields(known, out, optional=("name",))
    if missing:
        raise SpecError(f"{where}: missing field(s) {', '.join(missing)}")
    return out
