"""Qwen2.5-VL positions and windows (models.native_grid) against transformers' own code, and
its micro-batches (megatron.batch).

- the vision tower's 2-D rotary positions, full-attention segments and window order with its
  window bounds, for images of odd grid sizes (windows cut short at the right and bottom);
- the M-RoPE position ids of a packed micro-batch (text-only, one-image, two-image and video
  samples: videos of several temporal patches at fractional seconds per temporal patch, two
  in one sample) equal transformers' (5.24) `get_rope_index` of each sample alone;
- bad input (a grid the merge size does not divide, placeholders without a grid, a video
  without its seconds) names the problem.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_omnibal.models.native_grid import (
    frame_seqlens,
    mrope_position_ids,
    patch_rows_cols,
    window_index,
)

GRIDS = np.array([[1, 6, 10], [1, 16, 4], [2, 8, 8], [1, 2, 2]])
IMAGE, VIDEO = 150, 151
TOKENS_PER_SECOND = 2


def test_vision_positions_and_windows_equal_transformers() -> None:
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_position_ids,
        get_vision_window_index,
    )

    grid = torch.from_numpy(GRIDS)
    np.testing.assert_array_equal(patch_rows_cols(GRIDS, 2), get_vision_position_ids(grid, 2))
    np.testing.assert_array_equal(frame_seqlens(GRIDS), get_vision_cu_seqlens(grid))
    for window_px in (56, 112):
        order, bounds = window_index(GRIDS, 2, window_px // 28)
        ref_order, ref_bounds = get_vision_window_index(grid, 2, window_px, 14)
        np.testing.assert_array_equal(order, ref_order)
        np.testing.assert_array_equal(bounds, ref_bounds)


@pytest.fixture(scope="module")
def qwen_model() -> torch.nn.Module:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    cfg = Qwen2_5_VLConfig(
        vision_config={"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16,
                       "out_hidden_size": 16},
        text_config={"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "intermediate_size": 16, "vocab_size": 160,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                         "mrope_section": [1, 1, 2]}},
        image_token_id=IMAGE, video_token_id=VIDEO,
    )  # fmt: skip
    cfg.vision_config.tokens_per_second = TOKENS_PER_SECOND
    return Qwen2_5_VLModel(cfg).eval()


def _sample(rng: np.random.Generator, grids: list[list[int]]) -> np.ndarray:
    parts = [rng.integers(0, 100, rng.integers(1, 6))]
    for t, h, w in grids:
        parts += [[152], np.full(t * h * w // 4, IMAGE), [153], rng.integers(0, 100, 3)]
    return np.concatenate(parts).astype(np.int64)


def test_mrope_ids_of_a_packed_batch_equal_get_rope_index_per_sample(qwen_model) -> None:
    """Samples: an image, text only, two images, a video of 3 temporal patches at 1.25 s each
    (time steps 2.5), two videos (0.7 s: 1.4, truncated), a two-frame video, an image."""
    import transformers

    assert transformers.__version__ == "5.24.0", "the ids are pinned to transformers 5.24"
    rng = np.random.default_rng(0)
    samples = [([[1, 6, 10]], 0.0), ([], 0.0), ([[1, 16, 4], [1, 2, 2]], 0.0),
               ([[3, 4, 6]], 1.25), ([[5, 2, 4], [2, 6, 2]], 0.7), ([[1, 4, 4]], 1 / 3),
               ([[1, 8, 12]], 0.0)]  # fmt: skip
    tokens = [_sample(rng, g) for g, _ in samples]
    cu = np.concatenate([[0], np.cumsum([len(t) for t in tokens])])
    grids = np.array([g for s, _ in samples for g in s])
    seconds = np.array([sec for s, sec in samples for _ in s], np.float32)
    got = mrope_position_ids(np.concatenate(tokens), cu, grids, IMAGE, 2, seconds,
                             TOKENS_PER_SECOND)  # fmt: skip
    for k, (ids, (g, sec)) in enumerate(zip(tokens, samples, strict=True)):
        span = got[:, cu[k] : cu[k + 1]]
        if not g:  # transformers needs an image to build 3-D ids; text is arange on all axes
            np.testing.assert_array_equal(span, np.tile(np.arange(len(ids)), (3, 1)))
            continue
        ids_t = torch.from_numpy(ids)[None]
        slots = ids_t == IMAGE
        if sec:  # videos: transformers' video token, type 2, seconds per temporal patch
            kw = {"video_grid_thw": torch.tensor(g),
                  "second_per_grid_ts": torch.full((len(g),), sec, dtype=torch.float32)}
            ids_t, types = torch.where(slots, VIDEO, ids_t), slots.int() * 2
        else:
            kw, types = {"image_grid_thw": torch.tensor(g)}, slots.int()
        ref, _ = qwen_model.get_rope_index(ids_t, mm_token_type_ids=types, **kw)
        np.testing.assert_array_equal(span, ref[:, 0].numpy(), err_msg=f"sample {k}")
    video = got[0, cu[3] : cu[4]][np.concatenate(tokens[:4])[cu[3] : cu[4]] == IMAGE]
    assert sorted(set((video - video[0]).tolist())) == [0, 2, 5]  # 0, 2.5, 5.0 truncated


def test_bad_grids_name_the_problem() -> None:
    with pytest.raises(ValueError, match="not divisible by the merge size 2"):
        patch_rows_cols(np.array([[1, 3, 4]]), 2)
    tokens = np.array([1, IMAGE, IMAGE, 2])
    with pytest.raises(ValueError, match="no image grid left"):
        mrope_position_ids(tokens, np.array([0, 4]), np.zeros((0, 3)), IMAGE, 2)
    with pytest.raises(ValueError, match="needs 4 placeholder tokens"):
        mrope_position_ids(tokens, np.array([0, 4]), np.array([[1, 4, 4]]), IMAGE, 2)
    with pytest.raises(ValueError, match="2 temporal patches but no seconds per temporal"):
        mrope_position_ids(tokens, np.array([0, 4]), np.array([[2, 2, 2]]), IMAGE, 2)
    with pytest.raises(ValueError, match="1 image grids but 2 grid_seconds"):
        mrope_position_ids(tokens, np.array([0, 4]), np.array([[2, 2, 2]]), IMAGE, 2,
                           np.array([1.0, 1.0]))


def _spec():  # noqa: ANN202 - a tiny Qwen2.5-VL-shaped spec
    from megatron_omnibal.models.spec import LanguageSpec, ModelSpec, ProjectorSpec, VisionSpec

    vit = VisionSpec(num_layers=2, hidden_size=32, ffn_hidden_size=40, num_attention_heads=2,
                     image_size=28, patch_size=14, norm="rmsnorm", activation="silu",
                     class_token=False, patch_bias=False, native_resolution=True,
                     temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                     fullatt_block_indexes=(1,), gated_mlp=True)  # fmt: skip
    llm = LanguageSpec(num_layers=2, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                       vocab_size=160, mrope_section=(1, 1, 2))  # fmt: skip
    proj = ProjectorSpec(type="patch_merger", downsample=0.5, hidden_size=128)
    return ModelSpec(name="qwen", vit=vit, projector=proj, llm=llm, image_token_id=IMAGE)


def test_native_micro_batches_collate_validate_and_drop_samples() -> None:
    """Synthetic samples of a native-resolution model carry one image of the record's merged
    units; a packed micro-batch passes the checks, and dropping samples keeps exactly the
    others' tokens, patches and grids (as collating them alone would); mismatches are named."""
    from megatron_omnibal.data.lengths import from_arrays
    from megatron_omnibal.megatron.stream.batch import (
        collate,
        drop_samples,
        is_shape_only,
        synthetic_sample,
        validate_batch,
    )

    spec = _spec()
    lengths = from_arrays(np.array([3, 0, 4, 6]), np.array([20, 12, 30, 25]),
                          np.array([3, 0, 4, 6]))  # fmt: skip
    samples = [synthetic_sample(i, lengths, spec) for i in range(4)]
    assert [s.image_grid.tolist() for s in samples] == [[[1, 2, 6]], [], [[1, 4, 4]], [[1, 4, 6]]]
    samples[2].grid_seconds = torch.tensor([0.5])  # a two-frame video
    batch = collate(samples)
    assert batch.grid_seconds.tolist() == [0.0, 0.5, 0.0]
    args = (batch.tokens, batch.labels, batch.images, batch.image_flags, batch.cu_seqlens)
    validate_batch(spec, *args, batch.image_grid, batch.grid_seconds)
    dropped = drop_samples(batch, [0, 3], [len(s.images) for s in samples])
    alone = collate(samples[1:3])
    for key in ("tokens", "labels", "images", "image_grid", "grid_seconds", "image_flags",
                "cu_seqlens"):
        assert torch.equal(getattr(dropped, key), getattr(alone, key)), key
    with pytest.raises(ValueError, match="3 image grids but grid_seconds of shape \\(2,\\)"):
        validate_batch(spec, *args, batch.image_grid, batch.grid_seconds[:2])
    shape_only = collate([synthetic_sample(i, lengths, spec, pixels=False) for i in range(4)])
    assert is_shape_only(shape_only.images) and shape_only.images.shape == batch.images.shape
    with pytest.raises(ValueError, match="12 patches = 3 merged tokens"):
        validate_batch(spec, *args[:2], batch.images[:12], batch.image_flags[:1], args[4],
                       batch.image_grid[:1])  # fmt: skip
    with pytest.raises(ValueError, match="image_grid has shape None"):
        validate_batch(spec, *args)
