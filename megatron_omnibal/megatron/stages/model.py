"""The VLM pipeline-stage module: one rank's contiguous slice of the model.

Model order: [patch embedding, ViT layers, (ViT final norm), projector (+ merge of image
embeddings into the text sequence), LLM embedding, LLM layers, final norm + output head].
Pipeline rank r builds only what its StageLayout names, with megatron-core TransformerBlocks whose
layers carry GLOBAL layer numbers (checkpoints and the RNG depend on them) and the stage's own
recompute counts. The architecture is the spec's (models.spec): InternViT or CLIP, pixel-shuffle
or MLP projector, a Llama(-3)/Qwen2/Qwen3/InternLM2-style LLM, tied or separate output head; or
a native-resolution tower (megatron.native_vision: whole images in window order, windowed and
full attention, 2-D RoPE; Qwen2.5-VL, or Qwen3-VL with its patch-embedding bias and learned
position table, position_table.py), its patch merger and an LLM with M-RoPE (contiguous, or
Qwen3-VL's interleaved one, interleaved_mrope.py), whose positions every stage derives from the
micro-batch (`native`, restarting in every packed sample).

One tensor flows between stages: the ViT hidden states [patches, tiles, Cv] before the
projector's stage, the LLM hidden states [S, 1, H] (S / TP under sequence parallelism) after
it. With DeepStack (Qwen3-VL, deepstack.py) the taps travel in it too, concatenated along dim 0:
[hidden; tap; ...] of [patches, 1, Cv] each on ViT stages (the taps made so far, in ViT layer
order), [hidden [S (/ TP), 1, H]; block; ...] after the projector (a block holds one tap's
merged features of the image tokens in this rank's part of the sequence, [image tokens, 1, H];
one block per LLM layer not yet passed among 0, 1, ...). Each receiving stage splits it with
the micro-batch's patch count, padded sequence length and image positions and the layout's tap
counts. Shapes vary per micro-batch
(variable_seq_lengths). The projector stage embeds the token ids
itself (every PP rank reads the same micro-batch). Packed samples: with the local (torch) layer
specs, attention gets a block-diagonal causal mask built from cu_seqlens (DotProductAttention
does not take PackedSeqParams); with Transformer Engine specs, PackedSeqParams (THD) do the same
job. Under sequence parallelism the sequence is padded to a multiple of TP with a segment of its
own, stripped again at the head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import (
    MultimodalRotaryEmbedding,
    RotaryEmbedding,
)
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

from megatron_omnibal.megatron.stages.configs import StageConfigs, _recompute
from megatron_omnibal.megatron.stages.deepstack import (
    DeepStackCounts,
    DeepStackMergers,
    LocalImageRows,
    lay_out,
    local_features,
    local_image_rows,
    pack,
    set_slots,
    unpack,
    with_deepstack_layers,
)
from megatron_omnibal.megatron.stages.families import tower_hooks
from megatron_omnibal.megatron.stages.interleaved_mrope import InterleavedMRoPE
from megatron_omnibal.megatron.stages.layer_specs import HAVE_TE, block_spec, global_expert_name
from megatron_omnibal.megatron.stages.native_vision import NativeInputs, vision_attention_inputs
from megatron_omnibal.megatron.stages.projector import Projector
from megatron_omnibal.models.spec import ModelSpec
from megatron_omnibal.planner.plan_file.stage_layout import StageLayout


def packed_causal_mask(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[1, 1, S, S] bool, True = masked: causal within each packed sample, nothing across.

    Built where `cu_seqlens` lives without reading it back to the host: the segment ids get
    their size from `seq_len` (the batch check on the CPU made sure cu_seqlens span it)."""
    dev = cu_seqlens.device
    seg = torch.repeat_interleave(
        torch.arange(len(cu_seqlens) - 1, device=dev),
        (cu_seqlens[1:] - cu_seqlens[:-1]).long(),
        output_size=seq_len,
    )
    pos = torch.arange(seq_len, device=dev)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return ~allowed[None, None]


class VLMStage(MegatronModule):
    """Pipeline rank `stage`'s slice of the VLM (see the module docstring).

    forward(...) returns the tensor for the next stage, or on the head stage the per-token
    cross-entropy [1, S] (unmasked; step.loss_func applies the loss mask), or with labels=None
    the logits [1, S, padded vocab] gathered over TP. Set `capture` to a dict to also get the
    ViT features entering the projector ("vit", [tiles, tokens, Cv]) and the LLM's final hidden
    states ("llm", [S, H]) of the last forward on the stages that hold them.

    `level_recompute[l]` is the (ViT, LLM) layers this stage recomputes in a micro-batch of
    packing level l (forward's `level`); empty: the layout's counts for every micro-batch.

    With virtual stages (interleaved 1F1B) `layouts` are all pp x vpp of them, `stage` is this
    chunk's virtual stage and `vp_stage` its chunk index on the rank (megatron-core numbers and
    checkpoints the chunk's layers from it).
    """

    def __init__(
        self,
        spec: ModelSpec,
        layouts: list[StageLayout],
        stage: int,
        configs: StageConfigs,
        use_te: bool | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        level_recompute: Sequence[tuple[int, int]] = (),
        vp_stage: int | None = None,
    ) -> None:
        # The model-wide config (Megatron's schedules and finalize_model_grads read it) is the
        # LLM's, without qk_layernorm: HeadRMSNorm sums its own TP gradient (see layer_specs).
        super().__init__(config=dataclasses.replace(configs.llm, qk_layernorm=False))
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
        # finalize_model_grads finds the model by `pre_process` and reduces the gradient of a
        # tied embedding between the embedding's stage and the head's: with one chunk per
        # rank; with model chunks tied_head.py sums it instead (finalize_tied_grads).
        self.pre_process = stage == 0
        self.post_process = stage == self.num_stages - 1
        self.tied = spec.llm.tie_embeddings
        self.share_embeddings_and_output_weights = self.tied and vp_stage is None
        self.capture: dict[str, torch.Tensor] | None = None
        self.level_recompute = tuple(level_recompute)
        self.vp_stage = vp_stage
        if use_te is None:  # TE when importable, unless the config asks for local modules
            use_te = HAVE_TE and configs.llm.transformer_impl == "transformer_engine"
        if use_te and not HAVE_TE:
            raise ValueError("use_te=True but transformer_engine does not import")
        self.use_te = use_te
        self.input_tensor: torch.Tensor | None = None
        # The stage before (or at) the projector carries ViT hidden states.
        self.vision_stage = stage <= next(r for r, s in enumerate(layouts) if s.projector)
        # Built in model order: megatron-core draws each weight's initial values as it builds
        # it, so the order decides them.
        self.patch_embed = self._patch_embedding()
        self.vit = self._vit_block()
        self.vit_final_norm = None
        self.projector = None
        if self.layout.projector:
            v = spec.vit
            if v.post_norm:
                self.vit_final_norm = torch.nn.LayerNorm(v.hidden_size, eps=v.norm_eps)
            self.projector = Projector(configs.projector, spec)
        self.deepstack = DeepStackCounts.of(spec, self.layout)
        self.deepstack_mergers = None
        if self.layout.projector and spec.vit.deepstack_indexes:
            self.deepstack_mergers = DeepStackMergers(configs.projector, spec)
        self.embedding = self._llm_embedding()
        self.llm = self._llm_block()
        self.rotary = self._rotary_embedding() if self.llm is not None else None
        self.output_layer = self._output_layer()
        self._setup_tied_head()

    def _patch_embedding(self) -> torch.nn.Module | None:
        """The ViT's patch embedding, on the stage holding it."""
        if not self.layout.patch_embed:
            return None
        return tower_hooks(self.spec).patch_embedding(self.configs.vit, self.spec.vit)

    def _vit_block(self) -> TransformerBlock | None:
        """This stage's ViT layers. Every patch of a tile sees every other one; a
        native-resolution tower's masks (windows, whole images) come with each micro-batch."""
        lay, v, configs = self.layout, self.spec.vit, self.configs
        if not lay.num_vit_layers:
            return None
        tower = tower_hooks(self.spec).block(v, self.use_te)
        return TransformerBlock(
            configs.vit,
            block_spec(
                configs.vit,
                lay.num_vit_layers,
                tower.use_te,
                tower.mask_type,
                qkv_bias=v.qkv_bias,
                layer_scale=v.layer_scale,
                qk_norm=v.qk_norm,
                real_heads=configs.vit_real_heads,
                qk_norm_eps=v.qk_norm_eps,
                **tower.extra,
            ),
            post_layer_norm=False,
            pre_process=True,
            post_process=False,
            pg_collection=self.pg_collection,
            vp_stage=self.vp_stage,
        )

    def _llm_embedding(self) -> LanguageModelEmbedding | None:
        """The LLM's word embedding, on the stage holding it."""
        if not self.layout.llm_embed:
            return None
        return LanguageModelEmbedding(
            self.configs.llm,
            vocab_size=self.configs.padded_vocab_size,
            max_sequence_length=self.spec.llm.max_position_embeddings,
            position_embedding_type="rope",
            # Image embeddings are merged into the full sequence first, then scattered.
            scatter_to_sequence_parallel=False,
        )

    def _llm_block(self) -> TransformerBlock | None:
        """This stage's LLM layers (with the final norm on the head's stage).

        Local specs: the block-diagonal causal mask from packed_causal_mask, applied as an
        "arbitrary" mask (fused softmax kernels would otherwise assume plain causal). TE: causal
        inside each sample via PackedSeqParams."""
        lay, configs = self.layout, self.configs
        if not (lay.num_llm_layers or lay.head):
            return None
        spec = block_spec(
            configs.llm,
            lay.num_llm_layers,
            self.use_te,
            AttnMaskType.causal if self.use_te else AttnMaskType.arbitrary,
            head_qk_norm=self.spec.llm.qk_norm,
        )
        deepstack = bool(self.spec.vit.deepstack_indexes)
        block = TransformerBlock(
            configs.llm,
            with_deepstack_layers(spec) if deepstack else spec,
            post_layer_norm=True,
            pre_process=True,
            post_process=lay.head,
            pg_collection=self.pg_collection,
            vp_stage=self.vp_stage,
        )
        if deepstack:
            set_slots(block.layers, self.deepstack)
        return block

    def _rotary_embedding(
        self,
    ) -> RotaryEmbedding | MultimodalRotaryEmbedding | InterleavedMRoPE:
        """The LLM's RoPE: M-RoPE for a spec with sections, else RoPE with Llama-3 scaling,
        passed here (megatron-core 0.19's own VLM scripts drop it), and a factor only with
        scaling on."""
        llm, kv_channels = self.spec.llm, self.configs.llm.kv_channels
        if llm.mrope_interleaved:
            return InterleavedMRoPE(kv_channels, llm.rotary_base, llm.mrope_section)
        if llm.mrope_section:
            return MultimodalRotaryEmbedding(
                kv_channels, rotary_percent=1.0, rotary_base=llm.rotary_base
            )
        factor = llm.rope_scaling_factor
        scaling = {"rope_scaling": True, "rope_scaling_factor": factor} if factor else {}
        return RotaryEmbedding(
            kv_channels,
            rotary_percent=1.0,
            rotary_base=llm.rotary_base,
            use_cpu_initialization=not torch.cuda.is_available(),
            **scaling,
        )

    def _output_layer(self) -> tensor_parallel.ColumnParallelLinear | None:
        """The output head, on the last stage. A tied head on the embedding's own stage uses
        the embedding's weight."""
        if not self.layout.head:
            return None
        return tensor_parallel.ColumnParallelLinear(
            self.spec.llm.hidden_size,
            self.configs.padded_vocab_size,
            config=self.configs.llm,
            init_method=self.configs.llm.init_method,
            bias=False,
            gather_output=False,
            skip_weight_param_allocation=self._tied_on_this_stage,
        )

    @property
    def _tied_on_this_stage(self) -> bool:
        """A tied head on the embedding's own stage (it uses the embedding's weight)."""
        lay = self.layout
        return self.tied and lay.llm_embed and lay.head

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter | None:
        """The tied word embedding (embedding stage) or its copy in the head (last stage)."""
        if self.embedding is not None:
            return self.embedding.word_embeddings.weight
        if self.output_layer is not None:
            return self.output_layer.weight
        return None

    def _setup_tied_head(self) -> None:
        """Tied embeddings across stages, as megatron-core's LanguageModule: the head's copy
        starts equal to the embedding (zero + all-reduce over the embedding group), and the
        gradients are summed there by finalize_model_grads. A model chunk leaves the sum to
        tied_head.tie_chunks, once the rank has built all its chunks."""
        if not self.tied or self._tied_on_this_stage:
            return
        weight = self.shared_embedding_or_output_weight()
        if weight is None:
            return
        weight.shared_embedding = True
        if self.output_layer is not None:
            weight.shared = True  # counted once in the gradient norm
            with torch.no_grad():
                weight.zero_()
        if self.vp_stage is not None:
            return
        if torch.distributed.is_initialized() and parallel_state.is_rank_in_embedding_group():
            torch.distributed.all_reduce(weight.data, group=parallel_state.get_embedding_group())

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """megatron-core's default, with the output head as GPTModel saves it: vocabulary
        padding may differ between layouts, and a tied head on another stage than the embedding
        is a copy of the embedding (stored once, under the embedding's key), so a checkpoint
        loads whichever stages hold the two."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key = f"{prefix}output_layer.weight"
        if key not in state:
            return state
        if self.tied:
            dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
            state[key] = make_tp_sharded_tensor_for_checkpoint(
                tensor=self.output_layer.weight,
                key=f"{prefix}embedding.word_embeddings.weight",
                replica_id=(1, 0, dp_rank),  # a copy: the embedding's stage saves it
                allow_shape_mismatch=True,
                tp_group=self.pg_collection.tp,
                dp_cp_group=metadata["dp_cp_group"],
            )
        else:
            state[key].allow_shape_mismatch = True
        return state

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
        real_tiles: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        level: int = 0,
        native: NativeInputs | None = None,
        **_: Any,
    ) -> torch.Tensor:
        # Only computes: the micro-batch was checked on the CPU and its host-side facts
        # (real_tiles, max_seqlen) measured there (step.stage_inputs), so nothing here reads a
        # device value back.
        if self.level_recompute:
            self._recompute(*self.level_recompute[level])
        seq = tokens.shape[1]
        position_ids, cu_seqlens = self._pad_for_sequence_parallel(position_ids, cu_seqlens)
        seq_pad = position_ids.shape[1] - seq  # the pad segment's length
        x = None if self.stage == 0 else self.input_tensor
        blocks: list[torch.Tensor] = []  # DeepStack features still to add (deepstack.py)
        image_rows: LocalImageRows | None = None
        if self.vision_stage:
            taps: list[torch.Tensor] = []
            if x is not None and self.deepstack.vit_in:
                patches = native.rows_cols.shape[0]
                x, taps = unpack(x, patches, self.deepstack.vit_in, patches,
                                 f"stage {self.stage}")  # fmt: skip
            if self.patch_embed is not None:
                x = self.patch_embed(images, native) if native else self.patch_embed(images)
            if self.vit is not None and x.numel() > 0:
                x, made = self._vit(x, native)
                taps += made
            else:
                taps += [x] * len(self.deepstack.vit_taps)  # no patches: empty taps
                if x is self.input_tensor:
                    # A micro-batch without tiles: [P, 0, C] passes through (attention cannot
                    # reshape 0 elements); cloned (no data) so the schedule's backward reaches
                    # the input and deallocate_pipeline_outputs may free it (it refuses views).
                    x = x.clone()
            if self.projector is None:
                return pack(x, taps)
            if self.vit_final_norm is not None:
                x = self.vit_final_norm(x)
            if self.capture is not None:  # [tiles, tokens, C]; native: [patches, C]
                self.capture["vit"] = x.detach()[:, 0] if native else x.detach().transpose(0, 1)
            embeds = self.projector(x, native.unit_restore if native else real_tiles)
            x = self._merge(tokens, position_ids[:, :seq], embeds)
            if self.deepstack_mergers is not None:
                image_rows = self._image_rows(native, position_ids.shape[1])
                blocks = self._deepstack_blocks(taps, native, image_rows, x.dtype)
        elif self.deepstack.llm_in:
            image_rows = self._image_rows(native, position_ids.shape[1])
            rows = position_ids.shape[1] // self._sequence_parallel_size
            x, blocks = unpack(x, rows, self.deepstack.llm_in, image_rows.count,
                               f"stage {self.stage}")  # fmt: skip
        if self.llm is not None:
            context = lay_out(blocks, image_rows, x.shape[0]) if blocks else None
            x = self._llm(x, position_ids, cu_seqlens, max(max_seqlen, seq_pad), native, context)
            blocks = blocks[len(blocks) - self.deepstack.llm_out :]
        if self.output_layer is None:
            return pack(x, blocks)
        if self.capture is not None:
            hidden = x
            if self.configs.llm.sequence_parallel:
                hidden = tensor_parallel.gather_from_sequence_parallel_region(
                    x, tensor_parallel_output_grad=False
                )
            self.capture["llm"] = hidden.detach()[:seq, 0]
        tied = self.shared_embedding_or_output_weight() if self._tied_on_this_stage else None
        logits, _ = self.output_layer(x, weight=tied)  # [S_pad, 1, V/tp]
        logits = logits[:seq]
        if labels is None:
            full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            return full.transpose(0, 1).contiguous()  # [1, S, V]
        target = labels.transpose(0, 1).contiguous().clamp(min=0)
        loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), target)
        return loss.transpose(0, 1).contiguous()  # [1, S]

    def _vit(
        self, x: torch.Tensor, native: NativeInputs | None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(the hidden states after this stage's ViT layers, the DeepStack taps made here)."""
        if native is None:
            return self.vit(hidden_states=x, attention_mask=None), []
        masks, rope = vision_attention_inputs(native, self.spec.vit)
        taps = set(self.deepstack.vit_taps)
        if not taps:
            return self.vit(hidden_states=x, attention_mask=masks, rotary_pos_emb=rope), []
        x, made = self.vit(
            hidden_states=x, attention_mask=masks, rotary_pos_emb=rope, extract_layer_indices=taps
        )
        return x, list(made)

    def _deepstack_blocks(
        self, taps: list[torch.Tensor], native: NativeInputs, rows: LocalImageRows, dtype: Any
    ) -> list[torch.Tensor]:
        """Each tap merged, this rank's image rows of it ([rows, 1, H])."""
        merged = self.deepstack_mergers(taps, native.unit_restore)
        group = self.pg_collection.tp if self._sequence_parallel_size > 1 else None
        return [local_features(m.to(dtype), rows, group) for m in merged]

    def _image_rows(self, native: NativeInputs, padded_len: int) -> LocalImageRows:
        """Where this rank's part of the LLM sequence has its image tokens."""
        parts = self._sequence_parallel_size
        rank = torch.distributed.get_rank(self.pg_collection.tp) if parts > 1 else 0
        return local_image_rows(native.image_positions, padded_len, parts, rank)

    @property
    def _sequence_parallel_size(self) -> int:
        """The parts the LLM sequence is split into between TP ranks (1: not split)."""
        llm = self.configs.llm
        return llm.tensor_model_parallel_size if llm.sequence_parallel else 1

    def _recompute(self, vit_layers: int, llm_layers: int) -> None:
        """Recompute the first layers of each block in this micro-batch. megatron-core's
        TransformerBlock reads these config fields in its forward and checkpoints there, so
        the backward of each micro-batch follows its own forward's choice."""
        for block, layers in ((self.vit, vit_layers), (self.llm, llm_layers)):
            if block is not None:
                for key, value in _recompute(layers).items():  # as the config was built
                    setattr(block.config, key, value)

    def _pad_for_sequence_parallel(
        self, position_ids: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Under sequence parallelism the LLM sequence is padded to a multiple of TP: the pad
        tokens form a segment of their own (no real token attends to them) and are dropped at
        the head. Every stage derives the same padded length from the micro-batch."""
        tp = self.configs.llm.tensor_model_parallel_size
        seq = position_ids.shape[1]
        pad = (-seq) % tp if self.configs.llm.sequence_parallel else 0
        if pad == 0:
            return position_ids, cu_seqlens
        extra = torch.arange(pad, dtype=position_ids.dtype, device=position_ids.device)
        position_ids = torch.cat([position_ids, extra[None]], dim=1)
        end = cu_seqlens.new_tensor([seq + pad])
        return position_ids, torch.cat([cu_seqlens, end])

    def _merge(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        image_embeds: torch.Tensor,
    ) -> torch.Tensor:
        text = self.embedding(input_ids=tokens, position_ids=position_ids)  # [S, 1, H]
        is_image = (tokens == self.spec.image_token_id).transpose(0, 1)[..., None]  # [S, 1, 1]
        return self._scatter_sequence(text.masked_scatter(is_image, image_embeds.to(text.dtype)))

    def _scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[S, 1, H] -> this TP rank's part under sequence parallelism (padded to a multiple
        of TP first), else unchanged."""
        if self.configs.llm.sequence_parallel:
            tp = self.configs.llm.tensor_model_parallel_size
            pad = (-x.shape[0]) % tp
            if pad:
                x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
            x = tensor_parallel.scatter_to_sequence_parallel_region(x)
        return x

    def _mrope(self, position_ids: torch.Tensor, native: NativeInputs) -> torch.Tensor:
        """[S, 1, 1, d] M-RoPE angles of every token (a sequence-parallel pad segment counts on
        all three axes)."""
        ids = native.mrope_ids
        pad = position_ids[:, ids.shape[1] :].expand(3, -1)
        ids = torch.cat([ids, pad], dim=1)[:, None, :]
        return self.rotary(ids, list(self.spec.llm.mrope_section))

    def _llm(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_len: int,
        native: NativeInputs | None = None,
        context: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This stage's LLM layers; `context`: the DeepStack blocks of its first layers laid
        out [blocks, S, 1, H] (deepstack.py)."""
        seq = position_ids.shape[1]
        if self.use_te:
            # With THD packing megatron-core applies RoPE per sample from cu_seqlens (M-RoPE:
            # per token, on its unfused path).
            rope = self._mrope(position_ids, native) if native else self.rotary(max_len)
            cu = cu_seqlens.to(torch.int32).to(x.device)
            packed = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=max_len,
                max_seqlen_kv=max_len,
            )
            return self.llm(
                hidden_states=x, attention_mask=None, rotary_pos_emb=rope,
                packed_seq_params=packed, context=context,
            )  # fmt: skip
        if native is not None:
            rope = self._mrope(position_ids, native)
        else:
            rope = self.rotary(max_len)[position_ids[0]]  # [S, 1, 1, d]: restarts per sample
        mask = packed_causal_mask(cu_seqlens, seq).to(x.device)
        return self.llm(hidden_states=x, attention_mask=mask, rotary_pos_emb=rope, context=context)


# TE's fused modules hold the layer norms inside the next linear layer; model-wide names use the
# local modules' names so that a checkpoint reads the same with and without TE.
_TE_NAMES = (
    (".self_attention.linear_qkv.layer_norm_", ".input_layernorm."),
    (".mlp.linear_fc1.layer_norm_", ".pre_mlp_layernorm."),
)


def global_name(stage: VLMStage, local_name: str) -> str:
    """A parameter's model-wide name: `vit.layers.{i}` / `llm.layers.{i}` with i the 0-based
    GLOBAL layer index and experts by their global index (layer_specs.global_expert_name), so
    the same parameter has the same name whatever the pipeline and expert split."""
    parts = local_name.split(".")
    if parts[0] in ("vit", "llm") and len(parts) > 2 and parts[1] == "layers":
        block = getattr(stage, parts[0])
        parts[2] = str(block.layers[int(parts[2])].layer_number - 1)
    name = global_expert_name(".".join(parts), stage.configs.llm)
    for te, local in _TE_NAMES:
        name = name.replace(te, local)
    return name


def global_named_parameters(stage: VLMStage) -> dict[str, torch.nn.Parameter]:
    """This stage's parameters under model-wide names (see global_name)."""
    return {global_name(stage, n): p for n, p in stage.named_parameters()}
