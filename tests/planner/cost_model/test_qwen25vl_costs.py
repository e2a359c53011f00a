"""The planner's price of Qwen2.5-VL's vision tower: one block's FLOPs over known images against a
count by hand and against transformers' own window index, the per-tile rates against the exact
count where they are exact, the full-attention blocks priced as their own units, and a plan."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_omnibal.cli import main as cli_main
from megatron_omnibal.data.lengths import from_arrays, save_lengths
from megatron_omnibal.models.families.shared.qwen_native import DEFAULT_IMAGE_TILES, native_spans
from megatron_omnibal.models.presets import QWEN25_VIT, get_preset
from megatron_omnibal.planner.cost_model.costs import analytic_costs, workload_features
from megatron_omnibal.planner.cost_model.flops import ModelFlops, vit_layer_flops
from megatron_omnibal.planner.cost_model.hardware import get_hardware

# Patch grids (t, h, w): 8 x 12 patches (windows of 8 x 8 and 8 x 4), 4 x 6 (one window
# smaller than a full one), 20 x 18 (windows 8 x 8 four times, 8 x 2 twice, 4 x 8 twice, 4 x 2).
GRIDS = [(1, 8, 12), (1, 4, 6), (1, 20, 18)]
PER_PATCH = 2 * (1280 * 3840 + 1280 * 1280 + 3 * 1280 * 3420)  # qkv, proj, gate + up + down


def test_block_flops_by_hand() -> None:
    patches = 96 + 24 + 360
    window_pairs = (64**2 + 32**2) + 24**2 + (4 * 64**2 + 2 * 16**2 + 2 * 32**2 + 8**2)
    full_pairs = 96**2 + 24**2 + 360**2
    # Scores and weighted values: 2 matmuls of 2 x pairs x 1280 FLOPs each.
    assert vit_layer_flops(QWEN25_VIT, GRIDS, full=False) == patches * PER_PATCH + 4 * 1280 * (
        window_pairs)  # fmt: skip
    assert vit_layer_flops(QWEN25_VIT, GRIDS, full=True) == patches * PER_PATCH + 4 * 1280 * (
        full_pairs)  # fmt: skip
    # Two frames of a video attend separately in the full-attention blocks.
    assert vit_layer_flops(QWEN25_VIT, [(2, 4, 6)], full=True) == 48 * PER_PATCH + 4 * 1280 * (
        2 * 24**2)  # fmt: skip


def test_windows_are_transformers_windows() -> None:
    torch = pytest.importorskip("torch")
    from transformers.vision_utils import get_vision_window_index

    rng = np.random.default_rng(0)
    grids = [(1, 2 * int(a), 2 * int(b)) for a, b in rng.integers(1, 40, (30, 2))] + GRIDS
    _, cu = get_vision_window_index(torch.tensor(grids), spatial_merge_size=2, window_size=112,
                                    patch_size=14)  # fmt: skip
    sizes = np.diff(cu.numpy()).astype(np.int64)
    patches = sum(t * h * w for t, h, w in grids)
    want = patches * PER_PATCH + 4 * 1280 * int((sizes**2).sum())
    assert vit_layer_flops(QWEN25_VIT, grids, full=False) == want


def test_rates_per_tile_equal_the_exact_count_on_whole_windows() -> None:
    # 8 x 8, 16 x 8 patches (whole windows) and 4 x 6 (within one): 16, 32 and 6 merge groups.
    grids, tiles = [(1, 8, 8), (1, 16, 8), (1, 4, 6)], np.array([16, 32, 6])
    flops = ModelFlops.of(get_preset("qwen2.5-vl-7b"), tiles)
    total = tiles.sum()
    assert flops.vit_layer_per_tile * total == pytest.approx(
        vit_layer_flops(QWEN25_VIT, grids, full=False), rel=1e-12)  # fmt: skip
    assert flops.vit_full_layer_per_tile * total == pytest.approx(
        vit_layer_flops(QWEN25_VIT, grids, full=True), rel=1e-12)  # fmt: skip
    assert flops.vit_full_layers == 4 and flops.vit_layers == 32
    # Patch embedding: Conv3d over 2 frames of 14 x 14 x 3 per patch; merger per token.
    assert flops.patch_per_tile == 4 * 2 * (2 * 14 * 14 * 3) * 1280
    assert flops.projector_per_tile == 2 * (5120 * 5120 + 5120 * 3584)
    # Without data: images of transformers' default max_pixels (1280 merge groups).
    assert native_spans(QWEN25_VIT, None) == (64.0, 4.0 * DEFAULT_IMAGE_TILES)
    # A tiled ViT ignores the images: its patches attend within their tile.
    intern = get_preset("internvl2-8b")
    assert ModelFlops.of(intern, tiles) == ModelFlops.of(intern)


def test_full_attention_blocks_are_priced_as_their_own_units() -> None:
    model, hw = get_preset("qwen2.5-vl-7b"), get_hardware("H100-80G")
    tiles = np.array([256, 1024, 4096])
    cm = analytic_costs(model, hw, tp=2, image_tiles=tiles)
    flops = ModelFlops.of(model, tiles)
    fwd = cm.at(workload_features(1000, 0, 0)).forward_ms
    rate = hw.peak_tflops * 1e12 * hw.efficiency * 2 / 1e3
    full = [cm.names.index(f"vit.{i}") for i in (7, 15, 23, 31)]
    windowed = [i for i in range(32) if i not in full]
    assert np.ptp(fwd[full]) == pytest.approx(0.0, abs=1e-9)
    assert np.ptp(fwd[windowed]) == pytest.approx(0.0, abs=1e-9)
    gap = 1000 * (flops.vit_full_layer_per_tile - flops.vit_layer_per_tile) / rate
    assert fwd[7] - fwd[6] == pytest.approx(gap, rel=1e-9) and gap > 0
    # The patch embedding's input, counted by hand: 4 patches per merge group, each 3 channels
    # x 2 frames x 14 x 14 pixels in bf16; its Conv3d weight 1280 x 1176 (no bias, no table).
    pixels_mib = 4 * 3 * 2 * 14 * 14 * 2 / 2**20
    assert cm.first[2] @ workload_features(1, 0, 0) == pytest.approx(pixels_mib)
    assert model.patch_embed_params == 1280 * 3 * 2 * 14 * 14
    # Bigger images cost more per patch in the full-attention blocks only.
    small = analytic_costs(model, hw, tp=2, image_tiles=np.array([64])).at(
        workload_features(1000, 0, 0)).forward_ms  # fmt: skip
    assert small[6] == pytest.approx(fwd[6], rel=1e-3) and small[7] < fwd[7]


def test_plan_runs_on_qwen_lengths(tmp_path, capsys) -> None:
    rng = np.random.default_rng(0)
    tiles = 256 * rng.integers(1, 5, 400)  # images of 1 to 4 InternVL tiles' area
    save_lengths(from_arrays(tiles, tiles + rng.integers(60, 900, 400), tiles),
                 tmp_path / "q.npz")  # fmt: skip
    out = tmp_path / "plan.json"
    assert cli_main(["plan", "--model", "qwen2.5-vl-7b", "--hardware", "H100-80G", "--gpus", "4",
                     "--tp", "2", "--pp", "2", "--micro-batches", "4", "--global-batch", "32",
                     "--lengths", str(tmp_path / "q.npz"), "--out", str(out)]) == 0  # fmt: skip
    plan = json.loads(out.read_text())
    assert plan["model_spec"]["vit"]["fullatt_block_indexes"] == [7, 15, 23, 31]
    assert plan["data"]["pack_cost"]["tile_ms"][0] > 0
