"""Qwen3-VL's parts that megatron-core lacks, against transformers' own functions and modules:
the position table's taps and weights, the interleaved M-RoPE, the DeepStack bookkeeping per
stage; and that the tiny model of tests/helpers/qwen3_vl.py really depends on DeepStack and the
position table (so test_qwen3_vl_stages.py's equality to transformers covers both)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from megatron_omnibal.megatron.stages.deepstack import DeepStackCounts
from megatron_omnibal.megatron.stages.interleaved_mrope import InterleavedMRoPE
from megatron_omnibal.megatron.stages.layout import layout_from_counts
from megatron_omnibal.megatron.stages.position_table import position_taps
from megatron_omnibal.models.spec import ModelSpec
from tests.helpers import qwen3_vl

GRIDS = [[1, 4, 6], [2, 8, 4], [1, 2, 2], [1, 6, 6], [3, 34, 52], [1, 96, 20]]


@pytest.mark.parametrize("side", [4, 48])
def test_position_taps_equal_transformers(side: int) -> None:
    """Rows and float32 weights bit for bit, patches in block-major order, frames repeated."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    rows, weights = position_taps(np.array(GRIDS), side, 2)
    want_rows, want_weights = get_vision_interpolation_indices_and_weights(
        torch.tensor(GRIDS), num_grid_per_side=side, mode="bilinear", align_corners=True,
        spatial_merge_size=2,
    )  # fmt: skip
    assert torch.equal(torch.from_numpy(rows), want_rows)
    assert torch.equal(torch.from_numpy(weights), want_weights)


@pytest.mark.parametrize(("section", "head_dim"), [((24, 20, 20), 128), ((4, 2, 2), 16)])
def test_interleaved_mrope_equals_transformers(section: tuple, head_dim: int) -> None:
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    config = Qwen3VLTextConfig(head_dim=head_dim, rope_parameters={
        "rope_type": "default", "rope_theta": 5e5, "mrope_section": list(section),
        "mrope_interleaved": True})  # fmt: skip
    ids = torch.randint(0, 3000, (3, 1, 50), generator=torch.Generator().manual_seed(0))
    cos, sin = Qwen3VLTextRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), ids)
    angles = InterleavedMRoPE(head_dim, 5e5, section)(ids)  # [S, 1, 1, d]
    assert angles.shape == (50, 1, 1, head_dim)
    assert torch.equal(angles[:, 0, 0].cos(), cos[0]) and torch.equal(angles[:, 0, 0].sin(), sin[0])
    # Qwen2.5-VL's contiguous sections give other angles
    axes = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    contiguous = ids[axes, 0, :].T.float() * InterleavedMRoPE(head_dim, 5e5, section).inv_freq
    assert (contiguous - angles[:, 0, 0, : head_dim // 2]).abs().max() > 1


def test_deepstack_counts_per_stage() -> None:
    """Taps after ViT layers 0, 2, 3 over ViT stages [2, 2, 0] and LLM layers [0, 1, 3]."""
    spec = ModelSpec.from_dict(qwen3_vl.SPEC)
    layouts = layout_from_counts([2, 2, 0], [0, 1, 3], vit_layers=4, llm_layers=4)
    counts = [DeepStackCounts.of(spec, lay) for lay in layouts]
    assert [(c.vit_in, c.vit_out, c.vit_taps) for c in counts[:2]] == [(0, 1, (0,)),
                                                                        (1, 3, (2, 3))]
    assert [(c.llm_in, c.llm_out) for c in counts[1:]] == [(3, 2), (2, 0)]


def _logits_change(edit) -> float:  # noqa: ANN001
    model = qwen3_vl.hf_model(5)
    spec = ModelSpec.from_dict(qwen3_vl.SPEC)
    from tests.megatron.stages.test_qwen3_vl_stages import samples

    probe = [s for mb in samples(spec) for s in mb]
    ref = qwen3_vl.reference_logits(model, probe)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        edit(changed.model.visual)
    got = qwen3_vl.reference_logits(changed, probe)
    return float((got - ref).abs().max() / ref.abs().max())


def test_tiny_model_depends_on_deepstack_and_the_position_table() -> None:
    def no_deepstack(visual) -> None:  # noqa: ANN001
        for merger in visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()

    assert _logits_change(no_deepstack) > 1e-2
    assert _logits_change(lambda visual: visual.pos_embed.weight.zero_()) > 1e-2


def test_weight_rules_round_trip_bit_for_bit() -> None:
    """transformers' tensors -> canonical -> transformers' again, every tensor unchanged."""
    from megatron_omnibal.models.families.qwen3_vl.weights import rules

    spec = ModelSpec.from_dict(qwen3_vl.SPEC)
    state = qwen3_vl.hf_model(5).state_dict()
    canonical = qwen3_vl.canonical_from_hf(spec, state)
    back = {}
    for rule in rules(spec):
        back.update(zip(rule.hf, rule.to_hf(canonical[rule.canonical]), strict=True))
    assert len(back) == len(state)
    for name, t in state.items():
        rule_name = name.replace("model.language_model.", "language_model.model.", 1)
        rule_name = rule_name.replace("model.visual.", "visual.", 1)
        rule_name = rule_name.replace("lm_head.", "language_model.lm_head.", 1)
        assert torch.equal(back[rule_name], t), name
