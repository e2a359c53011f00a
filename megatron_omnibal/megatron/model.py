"""The VLM pipeline-stage module: one rank's contiguous slice of the model.

Model order: [patch embedding, ViT layers, projector (+ merge of image embeddings into the text
sequence), LLM embedding, LLM layers, final norm + output head]. Pipeline rank r builds only what
its StageLayout names, with megatron-core TransformerBlocks whose layers carry GLOBAL layer
numbers (checkpoints and the RNG depend on them) and the stage's own recompute counts.

Exactly one tensor flows between stages: the ViT hidden states [patches, tiles, Cv] before the
projector's stage, the LLM hidden states [S, 1, H] after it. Shapes vary per micro-batch
(variable_seq_lengths). The projector stage embeds the token ids itself (every PP rank reads the
same micro-batch). Packed samples: with the local (torch) layer specs, attention gets a
block-diagonal causal mask built from cu_seqlens (DotProductAttention does not take
PackedSeqParams); with Transformer Engine specs, PackedSeqParams (THD) do the same job.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omnibal.megatron.layout import StageLayout, validate_layout
from megatron_omnibal.megatron.projector import Projector
from megatron_omnibal.megatron.vision import PatchEmbedding
from megatron_omnibal.models.spec import ModelSpec

try:  # Transformer Engine is an optional accelerator.
    import transformer_engine  # noqa: F401
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )

    HAVE_TE = True
except ImportError:
    HAVE_TE = False


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's activation: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "quick_gelu": quick_gelu,
    "silu": F.silu,
    "relu": F.relu,
}


@dataclass
class StageConfigs:
    """TransformerConfigs of one stage: ViT layers, projector MLP, LLM (embedding/layers/head)."""

    vit: TransformerConfig
    projector: TransformerConfig
    llm: TransformerConfig
    padded_vocab_size: int


def padded_vocab(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Vocab rounded up to a multiple of divisible_by * tp, as Megatron pads it."""
    m = divisible_by * tp
    return int(math.ceil(vocab_size / m) * m)


def _tower_layout(layouts: list[StageLayout], tower: str) -> list[list[str]]:
    rows = []
    for r, st in enumerate(layouts):
        n = getattr(st, f"num_{tower}_layers")
        row = (["embedding"] if r == 0 else []) + ["decoder"] * n
        rows.append(row + (["loss"] if r == len(layouts) - 1 else []))
    return rows


def stage_configs(
    spec: ModelSpec,
    layouts: list[StageLayout],
    stage: int,
    tp_size: int = 1,
    overrides: dict[str, Any] | None = None,
) -> StageConfigs:
    """The TransformerConfigs stage `stage` builds with: per-tower PP layout (so megatron-core
    numbers the layers globally), this stage's recompute counts, and shared training settings.

    `overrides` are TransformerConfig fields applied to every tower (dtype, dropout, fusions...).
    """
    validate_layout(layouts, spec.vit.num_layers, spec.llm.num_layers)
    pp = len(layouts)
    st = layouts[stage]
    base: dict[str, Any] = {
        "tensor_model_parallel_size": tp_size,
        "pipeline_model_parallel_size": pp,
        "pipeline_dtype": torch.float32,
        "params_dtype": torch.float32,
        "variable_seq_lengths": True,
        # TransformerConfig rejects variable_seq_lengths with the default allgather dispatcher,
        # even without MoE.
        "moe_token_dispatcher_type": "alltoall",
        "calculate_per_token_loss": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "layernorm_epsilon": 1e-6,
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        "persist_layer_norm": False,
        # As megatron.training does: free sent activations (stage outputs are never views).
        "deallocate_pipeline_outputs": True,
    }
    base.update(overrides or {})
    if base.get("sequence_parallel"):
        # The projector stage merges image embeddings into the full text sequence, and the ViT
        # batch is tiles, not tokens: neither is split along the sequence.
        raise ValueError("sequence_parallel is not supported by the VLM stage module")
    groups = spec.llm.num_query_groups or spec.llm.num_attention_heads
    if spec.llm.num_attention_heads % tp_size or groups % tp_size:
        raise ValueError(
            f"tensor parallel size {tp_size} must divide the LLM's attention heads "
            f"({spec.llm.num_attention_heads}) and query groups ({groups})"
        )
    if spec.vit.num_attention_heads % tp_size:
        raise ValueError(
            f"tensor parallel size {tp_size} must divide the ViT's attention heads "
            f"({spec.vit.num_attention_heads})"
        )

    def recompute(k: int) -> dict[str, Any]:
        if k == 0:
            return {
                "recompute_granularity": None,
                "recompute_method": None,
                "recompute_num_layers": None,
            }
        return {
            "recompute_granularity": "full",
            "recompute_method": "block",
            "recompute_num_layers": k,
        }

    def layout_arg(tower: str) -> dict[str, Any]:
        return {"pipeline_model_parallel_layout": _tower_layout(layouts, tower)} if pp > 1 else {}

    norm = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
    vit = TransformerConfig(
        **{
            **base,
            "num_layers": spec.vit.num_layers,
            "hidden_size": spec.vit.hidden_size,
            "ffn_hidden_size": spec.vit.ffn_hidden_size,
            "num_attention_heads": spec.vit.num_attention_heads,
            "normalization": norm[spec.vit.norm],
            "layernorm_epsilon": spec.vit.norm_eps,
            "add_bias_linear": True,
            "add_qkv_bias": True,
            "gated_linear_unit": False,
            "activation_func": ACTIVATIONS[spec.vit.activation],
            **recompute(st.vit_recompute),
            **layout_arg("vit"),
        }
    )
    projector = TransformerConfig(
        **{
            **base,
            "num_layers": 1,
            "pipeline_model_parallel_size": 1,
            "hidden_size": spec.llm.hidden_size,
            "ffn_hidden_size": spec.projector.hidden_size,
            "num_attention_heads": spec.llm.num_attention_heads,
            "layernorm_epsilon": spec.projector.norm_eps,
            "add_bias_linear": True,
            "gated_linear_unit": False,
            "activation_func": ACTIVATIONS[spec.projector.activation],
        }
    )
    llm = TransformerConfig(
        **{
            **base,
            "num_layers": spec.llm.num_layers,
            "hidden_size": spec.llm.hidden_size,
            "ffn_hidden_size": spec.llm.ffn_hidden_size,
            "num_attention_heads": spec.llm.num_attention_heads,
            "num_query_groups": spec.llm.num_query_groups,
            "normalization": norm[spec.llm.norm],
            "layernorm_epsilon": spec.llm.norm_eps,
            "add_bias_linear": False,
            "add_qkv_bias": spec.llm.qkv_bias,
            "gated_linear_unit": spec.llm.gated_mlp,
            "activation_func": ACTIVATIONS[spec.llm.activation],
            **recompute(st.llm_recompute),
            **layout_arg("llm"),
        }
    )
    return StageConfigs(vit, projector, llm, padded_vocab(spec.llm.vocab_size, tp_size))


def _layer_spec(config: TransformerConfig, use_te: bool, mask_type: AttnMaskType) -> ModuleSpec:
    """megatron-core's GPT layer spec (TE when importable, else local torch modules) with the
    self-attention mask type of this tower."""
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(normalization=config.normalization)
    else:
        spec = get_gpt_layer_local_spec(normalization=config.normalization)
    spec = copy.deepcopy(spec)
    attn = spec.submodules.self_attention
    attn.params = {**attn.params, "attn_mask_type": mask_type}
    return spec


def packed_causal_mask(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[1, 1, S, S] bool, True = masked: causal within each packed sample, nothing across."""
    dev = cu_seqlens.device
    seg = torch.repeat_interleave(
        torch.arange(len(cu_seqlens) - 1, device=dev), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    )
    if len(seg) != seq_len:
        raise ValueError(f"cu_seqlens cover {len(seg)} tokens, the sequence has {seq_len}")
    pos = torch.arange(seq_len, device=dev)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return ~allowed[None, None]


def validate_batch(
    spec: ModelSpec,
    tokens: torch.Tensor,
    labels: torch.Tensor | None,
    images: torch.Tensor,
    image_flags: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> None:
    """Raise ValueError unless the micro-batch fits the model (shapes, placeholders, bounds)."""
    if tokens.dim() != 2 or tokens.shape[0] != 1:
        raise ValueError(f"micro-batch tokens have shape {tuple(tokens.shape)}, expected [1, S]")
    seq = tokens.shape[1]
    if labels is not None and labels.shape != tokens.shape:
        raise ValueError(f"micro-batch labels {tuple(labels.shape)} != tokens {(1, seq)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != seq:
        raise ValueError(f"micro-batch cu_seqlens {cu_seqlens.tolist()} do not span 0..{seq}")
    size = spec.vit.image_size
    if images.dim() != 4 or tuple(images.shape[1:]) != (3, size, size):
        raise ValueError(
            f"micro-batch images have shape {tuple(images.shape)}, expected [n, 3, {size}, {size}]"
        )
    if image_flags.shape != (images.shape[0],):
        raise ValueError(
            f"micro-batch has {images.shape[0]} tiles but {image_flags.numel()} image_flags"
        )
    slots = int((tokens == spec.image_token_id).sum())
    real = int(image_flags.sum())
    if slots != real * spec.tokens_per_tile:
        raise ValueError(
            f"micro-batch has {slots} image placeholder tokens (id {spec.image_token_id}) but "
            f"{real} real tiles x {spec.tokens_per_tile} tokens per tile = "
            f"{real * spec.tokens_per_tile}"
        )


class VLMStage(MegatronModule):
    """Pipeline rank `stage`'s slice of the VLM (see the module docstring).

    forward(...) returns the tensor for the next stage, or on the head stage the per-token
    cross-entropy [1, S] (unmasked; step.loss_func applies the loss mask).
    """

    def __init__(
        self,
        spec: ModelSpec,
        layouts: list[StageLayout],
        stage: int,
        configs: StageConfigs,
        use_te: bool | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=configs.llm)
        # Megatron's schedules read model_type; the VLM pipeline is one decoder-style chain.
        self.model_type = ModelType.encoder_or_decoder
        # megatron.training's train() reads the model's process groups (GPTModel keeps them
        # the same way); default: parallel_state's groups, which the submodules use.
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection = pg_collection
        self.spec = spec
        self.layout = layouts[stage]
        self.stage = stage
        self.num_stages = len(layouts)
        self.configs = configs
        if use_te is None:  # TE when importable, unless the config asks for local modules
            use_te = HAVE_TE and configs.llm.transformer_impl == "transformer_engine"
        if use_te and not HAVE_TE:
            raise ValueError("use_te=True but transformer_engine does not import")
        self.use_te = use_te
        self.input_tensor: torch.Tensor | None = None
        lay = self.layout
        grid = spec.vit.image_size // spec.vit.patch_size

        # The stage before (or at) the projector carries ViT hidden states.
        self.vision_stage = stage <= next(r for r, s in enumerate(layouts) if s.projector)
        self.patch_embed = (
            PatchEmbedding(
                configs.vit, spec.vit.image_size, spec.vit.patch_size, spec.vit.class_token
            )
            if lay.patch_embed
            else None
        )
        self.vit = None
        if lay.num_vit_layers:
            self.vit = TransformerBlock(
                configs.vit,
                # Every patch of a tile sees every other one.
                _layer_spec(configs.vit, self.use_te, AttnMaskType.no_mask),
                post_layer_norm=False,
                pre_process=True,
                post_process=False,
                pg_collection=pg_collection,
            )
        self.projector = None
        self.embedding = None
        if lay.projector:
            self.projector = Projector(
                configs.projector,
                spec.projector.type,
                spec.vit.hidden_size,
                grid,
                spec.projector.downsample,
                skip_tokens=int(spec.vit.class_token),
            )
        if lay.llm_embed:
            self.embedding = LanguageModelEmbedding(
                configs.llm,
                vocab_size=configs.padded_vocab_size,
                max_sequence_length=spec.llm.max_position_embeddings,
                position_embedding_type="rope",
            )
        self.llm = None
        self.rotary = None
        if lay.num_llm_layers or lay.head:
            self.llm = TransformerBlock(
                configs.llm,
                # Local specs: the block-diagonal causal mask from packed_causal_mask, applied
                # as an "arbitrary" mask (fused softmax kernels would otherwise assume plain
                # causal). TE: causal inside each sample via PackedSeqParams.
                _layer_spec(
                    configs.llm,
                    self.use_te,
                    AttnMaskType.causal if self.use_te else AttnMaskType.arbitrary,
                ),
                post_layer_norm=True,
                pre_process=True,
                post_process=lay.head,
                pg_collection=pg_collection,
            )
            self.rotary = RotaryEmbedding(
                configs.llm.kv_channels,
                rotary_percent=1.0,
                rotary_base=spec.llm.rotary_base,
                use_cpu_initialization=not torch.cuda.is_available(),
            )
        self.output_layer = None
        if lay.head:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                spec.llm.hidden_size,
                configs.padded_vocab_size,
                config=configs.llm,
                init_method=configs.llm.init_method,
                bias=False,
                gather_output=False,
            )

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor] | None) -> None:
        """Called by Megatron's pipeline schedules with the previous stage's output."""
        if isinstance(input_tensor, list):
            if len(input_tensor) != 1:
                raise ValueError(f"VLMStage expects one input tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        labels: torch.Tensor | None,
        images: torch.Tensor,
        image_flags: torch.Tensor,
        cu_seqlens: torch.Tensor,
        **_: Any,
    ) -> torch.Tensor:
        # Every stage checks the (shared) micro-batch before any communication, so a bad one
        # stops all pipeline ranks with the same error instead of hanging the others.
        validate_batch(self.spec, tokens, labels, images, image_flags, cu_seqlens)
        x = None if self.stage == 0 else self.input_tensor
        if self.vision_stage:
            if self.patch_embed is not None:
                x = self.patch_embed(images)
            if self.vit is not None and x.shape[1] > 0:
                x = self.vit(hidden_states=x, attention_mask=None)
            elif x is self.input_tensor:
                # A micro-batch without tiles: [P, 0, C] passes through (attention cannot
                # reshape 0 elements); cloned (no data) so the schedule's backward reaches the
                # input and deallocate_pipeline_outputs may free it (it refuses views).
                x = x.clone()
            if self.projector is None:
                return x
            x = self._merge(tokens, position_ids, image_flags, self.projector(x, image_flags))
        if self.llm is not None:
            x = self._llm(x, position_ids, cu_seqlens)
        if self.output_layer is None:
            return x
        logits, _ = self.output_layer(x)  # [S, 1, V/tp]
        target = labels.transpose(0, 1).contiguous().clamp(min=0)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), target)
        return loss.transpose(0, 1).contiguous()  # [1, S]

    def _merge(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        image_flags: torch.Tensor,
        image_embeds: torch.Tensor,
    ) -> torch.Tensor:
        text = self.embedding(input_ids=tokens, position_ids=position_ids)  # [S, 1, H]
        is_image = (tokens == self.spec.image_token_id).transpose(0, 1)[..., None]  # [S, 1, 1]
        return text.masked_scatter(is_image, image_embeds.to(text.dtype))

    def _llm(
        self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        seq = x.shape[0]
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if self.use_te:
            # With THD packing megatron-core applies RoPE per sample from cu_seqlens.
            rope = self.rotary(max_len)
            cu = cu_seqlens.to(torch.int32).to(x.device)
            packed = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
            )
            return self.llm(
                hidden_states=x, attention_mask=None, rotary_pos_emb=rope, packed_seq_params=packed
            )
        rope = self.rotary(max_len)[position_ids[0]]  # [S, 1, 1, d]: restarts per sample
        mask = packed_causal_mask(cu_seqlens, seq).to(x.device)
        return self.llm(hidden_states=x, attention_mask=mask, rotary_pos_emb=rope)


def global_named_parameters(stage: VLMStage) -> dict[str, torch.nn.Parameter]:
    """This stage's parameters under model-wide names: local layer indices become global.

    `vit.layers.{i}` / `llm.layers.{i}` with i the 0-based global layer index, so the same
    parameter has the same name whatever the pipeline split (checkpoint conversion, tests).
    """
    out = {}
    for name, p in stage.named_parameters():
        parts = name.split(".")
        if parts[0] in ("vit", "llm") and len(parts) > 2 and parts[1] == "layers":
            block = getattr(stage, parts[0])
            parts[2] = str(block.layers[int(parts[2])].layer_number - 1)
        out[".".join(parts)] = p
    return out
