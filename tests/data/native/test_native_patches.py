"""Qwen2.5-VL image preprocessing (data.native_patches) against transformers' own image processor,
built locally from its settings: images of odd sizes (below min_pixels, above max_pixels, halves
that round to even, long thin ones) give the processor's pixel values and grid, with the
checkpoint's mean and std."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_omnibal.data.formats.generate import image_array
from megatron_omnibal.data.images.tiles import ImageDecodeError
from megatron_omnibal.data.images.tiling import TilingConfig
from megatron_omnibal.data.native.patches import image_patches, image_to_patches, native_grid

SIZES = [(37, 901), (333, 517), (1999, 13), (28, 28), (14, 42), (97, 3), (5, 1000), (1, 150),
         (419, 419), (770, 406)]  # fmt: skip
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.3, 0.25)


def test_image_patches_equal_the_processor() -> None:
    """A still image of odd size (multiples of 28 px, so the processor does not resize it)
    becomes the processor's patches and grid: block-major, each frame repeated twice."""
    from transformers import Qwen2VLImageProcessor

    rng = np.random.default_rng(0)
    image = rng.random((3, 84, 140), dtype=np.float32)
    processor = Qwen2VLImageProcessor(do_resize=False, do_rescale=False, do_normalize=False)
    ref = processor(images=torch.from_numpy(image), return_tensors="pt")
    patches, grid = image_patches(image, 14, 2, 2)
    assert list(grid) == ref["image_grid_thw"][0].tolist() == [1, 6, 10]
    np.testing.assert_array_equal(patches, ref["pixel_values"].numpy())
    with pytest.raises(ValueError, match="multiples of 28"):
        image_patches(image[:, :70], 14, 2, 2)


@pytest.mark.parametrize(("low", "high", "mean", "std"), [
    (56 * 56, 28 * 28 * 64, MEAN, STD),
    (28 * 28 * 16, 28 * 28 * 300, None, None),  # the processor's own (OpenAI CLIP) mean, std
])  # fmt: skip
def test_patches_and_grid_equal_the_image_processor(low, high, mean, std) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    colours = {"image_mean": list(mean), "image_std": list(std)} if mean else {}
    processor = Qwen2VLImageProcessorPil(min_pixels=low, max_pixels=high, patch_size=14,
                                         merge_size=2, temporal_patch_size=2, **colours)
    tiling = TilingConfig(mode="native", tile=28, tokens_per_tile=1, max_tiles=1,
                          min_pixels=low, max_pixels=high, image_mean=mean, image_std=std)
    rng = np.random.default_rng(1)
    for width, height in SIZES:
        image = Image.fromarray(image_array(width, height, noise=256, rng=rng), "RGB")
        ref = processor(images=[image], return_tensors="np")
        want_grid = ref["image_grid_thw"][0].tolist()
        units = want_grid[1] * want_grid[2] // 4
        patches, grid = image_to_patches(image, tiling, 14, 2, units, "img")
        assert list(grid) == want_grid == list(native_grid(width, height, tiling, 14))
        assert patches.dtype == np.float32 and patches.shape == ref["pixel_values"].shape
        np.testing.assert_allclose(patches, ref["pixel_values"], rtol=0, atol=1e-5,
                                   err_msg=f"{width}x{height}")


def test_an_image_that_changed_since_stats_is_named() -> None:
    tiling = TilingConfig(mode="native", tile=28, tokens_per_tile=1, max_tiles=1)
    image = Image.fromarray(image_array(56, 84, (10, 20, 30)), "RGB")
    with pytest.raises(ImageDecodeError, match=r"a/b.png: 6 merge groups from the 56x84 image, "
                                               r"the length file counts 5"):
        image_to_patches(image, tiling, 14, 2, 5, "a/b.png")
