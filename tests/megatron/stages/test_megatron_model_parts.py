"""Pieces of the VLM stage module checked against brute-force references, in-process:
the packed attention mask, pixel shuffle, micro-batch packing, synthetic samples, the per-token
loss."""

from __future__ import annotations

import pytest
import torch

from megatron_omnibal.data.lengths import from_arrays
from megatron_omnibal.megatron.stages.configs import padded_vocab
from megatron_omnibal.megatron.stages.model import packed_causal_mask
from megatron_omnibal.megatron.stages.projector import pixel_shuffle
from megatron_omnibal.megatron.stages.step import loss_func
from megatron_omnibal.megatron.stream.batch import IGNORE_INDEX, Sample, collate, synthetic_sample
from megatron_omnibal.models.presets import PRESETS

TINY = PRESETS["tiny"]


def test_packed_mask_matches_brute_force() -> None:
    lengths = [3, 1, 4]
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    mask = packed_causal_mask(cu, 8)[0, 0]
    owner = [i for i, n in enumerate(lengths) for _ in range(n)]
    for q in range(8):
        for k in range(8):
            allowed = owner[q] == owner[k] and k <= q
            assert bool(mask[q, k]) == (not allowed), (q, k)


def test_packed_mask_rejects_wrong_length() -> None:
    # validate_batch names the mismatch on the CPU first; the device-side mask only sizes it
    with pytest.raises(RuntimeError, match="size does not match"):
        packed_causal_mask(torch.tensor([0, 4], dtype=torch.int32), 5)


def test_pixel_shuffle_matches_transformers_internvl() -> None:
    """Oracle: transformers' own InternVLModel.pixel_shuffle (ps_version v2 order)."""
    from transformers.models.internvl.modeling_internvl import InternVLModel

    grid, f, n, c = 4, 2, 3, 5
    x = torch.randn(n, grid * grid, c)
    hf = InternVLModel.pixel_shuffle(None, x.reshape(n, grid, grid, c), scale_factor=1 / f)
    assert torch.equal(pixel_shuffle(x, grid, f), hf.reshape(n, -1, c * f * f))
    # ps_version v1 leaves the shuffled grid transposed
    g = grid // f
    v1 = pixel_shuffle(x, grid, f, version=1).reshape(n, g, g, -1)
    assert torch.equal(v1.transpose(1, 2), hf)
    with pytest.raises(ValueError, match="15 patches are not a 4x4 grid"):
        pixel_shuffle(x[:, :15], grid, f)


def sample(tokens: list[int], labels: list[int], tiles: int, real: int) -> Sample:
    flags = torch.zeros(tiles, dtype=torch.int64)
    flags[:real] = 1
    return Sample(torch.tensor(tokens), torch.tensor(labels), torch.randn(tiles, 3, 4, 4), flags)


def test_collate_packs_in_order() -> None:
    a = sample([5, 6, 7], [6, 7, IGNORE_INDEX], 2, 1)
    b = sample([8, 9], [IGNORE_INDEX, 3], 0, 0)
    c = sample([1], [2], 1, 1)
    mb = collate([a, b, c])
    assert mb.tokens.tolist() == [[5, 6, 7, 8, 9, 1]]
    assert mb.labels.tolist() == [[6, 7, IGNORE_INDEX, IGNORE_INDEX, 3, 2]]
    assert mb.loss_mask.tolist() == [[1, 1, 0, 0, 1, 1]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 0]]
    assert mb.cu_seqlens.tolist() == [0, 3, 5, 6] and mb.cu_seqlens.dtype == torch.int32
    assert torch.equal(mb.images, torch.cat([a.images, c.images]))
    assert mb.image_flags.tolist() == [1, 0, 1]
    assert mb.num_samples == 3


def test_collate_errors() -> None:
    with pytest.raises(ValueError, match="no samples"):
        collate([])
    with pytest.raises(ValueError, match="sample 1 has tokens"):
        collate([sample([1], [2], 0, 0), sample([1, 2], [2], 0, 0)])


def test_synthetic_sample_has_the_record_shape() -> None:
    stats = from_arrays([3, 1, 0], [40, 9, 5], [2, 0, 0])
    tpt = TINY.tokens_per_tile
    for i in range(3):
        s = synthetic_sample(i, stats, TINY, seed=7)
        assert len(s.tokens) == stats.tokens[i]
        assert s.images.shape == (stats.vit[i], 3, 16, 16)
        assert int(s.image_flags.sum()) == stats.image_flags[i]
        assert int((s.tokens == TINY.image_token_id).sum()) == stats.image_flags[i] * tpt
        assert int(s.tokens.min()) >= 0 and int(s.tokens.max()) < TINY.llm.vocab_size
        keep = s.labels != IGNORE_INDEX
        assert keep.any()
        # labels are the next token wherever there is a loss; never an image placeholder
        nxt = torch.cat([s.tokens[1:], torch.tensor([-1])])
        assert torch.equal(s.labels[keep], nxt[keep])
        assert not (s.labels == TINY.image_token_id).any()
        again = synthetic_sample(i, stats, TINY, seed=7)
        assert torch.equal(again.tokens, s.tokens) and torch.equal(again.images, s.images)
    assert not torch.equal(
        synthetic_sample(0, stats, TINY, 8).tokens, synthetic_sample(0, stats, TINY, 7).tokens
    )


def test_synthetic_sample_errors() -> None:
    stats = from_arrays([2], [8], [2])  # 2 real tiles x 4 image tokens leave no text
    with pytest.raises(ValueError, match="record 0 has token_num=8"):
        synthetic_sample(0, stats, TINY)
    with pytest.raises(IndexError, match="index 1 outside"):
        synthetic_sample(1, stats, TINY)


def test_loss_func_sums_masked_tokens() -> None:
    losses = torch.tensor([[0.5, 2.0, 1.0, 4.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    total, n, report = loss_func(mask, losses)
    assert float(total) == 5.5 and int(n) == 3
    assert report["lm loss"].tolist() == [5.5, 3.0]
    with pytest.raises(ValueError, match="4 per-token losses but 3"):
        loss_func(mask[:, :3], losses)


def test_padded_vocab() -> None:
    assert padded_vocab(92553, 1) == 92672 and padded_vocab(92553, 2) % 256 == 0
    assert padded_vocab(256, 2) == 256


def test_validate_batch_names_what_is_wrong() -> None:
    from megatron_omnibal.megatron.stream.batch import validate_batch

    stats = from_arrays([2, 1], [30, 9], [2, 0])
    mb = collate([synthetic_sample(i, stats, TINY, seed=1) for i in range(2)])
    args = (mb.tokens, mb.labels, mb.images, mb.image_flags, mb.cu_seqlens)
    validate_batch(TINY, *args)  # a good one passes
    flags = mb.image_flags.clone()
    flags[2] = 1  # the dummy tile claims to be real: 4 placeholders are missing
    with pytest.raises(ValueError, match="8 image placeholder tokens.*3 real tiles x 4.*= 12"):
        validate_batch(TINY, mb.tokens, mb.labels, mb.images, flags, mb.cu_seqlens)
    with pytest.raises(ValueError, match="cu_seqlens \\[0, 30\\] do not span 0..39"):
        validate_batch(TINY, *args[:4], torch.tensor([0, 30], dtype=torch.int32))
    with pytest.raises(ValueError, match="images have shape \\(3, 3, 8, 8\\)"):
        validate_batch(TINY, mb.tokens, mb.labels, torch.zeros(3, 3, 8, 8), mb.image_flags,
                       mb.cu_seqlens)  # fmt: skip


def test_patch_embedding_gradients_accumulate_after_a_one_tile_micro_batch() -> None:
    """A micro-batch of one tile first, then another: the class token's and the position
    embedding's gradients are the sums of each micro-batch's alone. (With one tile the two
    gradients were views of one tensor, which torch's gradient accumulation kept as the
    parameters' .grad: the second micro-batch's sum into one changed the other.)"""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_omnibal.megatron.stages.vision import PatchEmbedding

    vit = PRESETS["tiny"].vit
    config = TransformerConfig(num_layers=1, hidden_size=vit.hidden_size, num_attention_heads=4)
    embed = PatchEmbedding(config, vit)
    assert embed.class_token is not None
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, 3, vit.image_size, vit.image_size, generator=g) for n in (1, 2)]
    weights = [torch.randn(vit.seq_per_tile, n, vit.hidden_size, generator=g) for n in (1, 2)]

    def grads(which: list[int]) -> dict[str, torch.Tensor]:
        embed.zero_grad(set_to_none=True)
        for i in which:
            (embed(batches[i]) * weights[i]).sum().backward()
        return {n: p.grad.clone() for n, p in embed.named_parameters()}

    alone = [grads([0]), grads([1])]
    both = grads([0, 1])
    for name, value in both.items():
        torch.testing.assert_close(value, alone[0][name] + alone[1][name], msg=name)
