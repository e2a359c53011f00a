"""A sample's media (data/sample/media.py), the one rule stats and training render and count
images, InternVL frames and native videos by."""

import pytest

from megatron_omnibal.data.images.tiling import TilingConfig
from megatron_omnibal.data.sample.media import dataset_tiling, sample_media
from megatron_omnibal.data.text import conversations as conv


def test_images_carry_their_tiles_and_a_text_only_sample_its_dummy_tiles() -> None:
    media = sample_media(conv.INTERNVL_IMAGE, False, [3, 5], [])
    assert [m.placeholder for m in media.media] == [conv.IMAGE_PLACEHOLDER] * 2
    assert media.vision(dummy_tile=1) == (8, 8)
    assert sample_media(conv.INTERNVL_IMAGE, False, [], []).vision(dummy_tile=1) == (1, 0)


def test_an_internvl_video_is_its_frames_one_tile_each() -> None:
    media = sample_media(conv.INTERNVL_IMAGE, False, [], [3, 2])
    assert media.units == [1] * 5 and media.vision(dummy_tile=1) == (5, 5)
    assert [m.text.count("Frame") for m in media.media] == [3, 2]
    with pytest.raises(conv.SampleError, match="start and end tokens"):
        sample_media(conv.LLAVA_IMAGE, False, [], [3])


def test_a_native_video_is_one_placeholder_of_its_merge_groups() -> None:
    media = sample_media(conv.QWEN_VL_IMAGE, True, [], [12, 4])
    assert [m.placeholder for m in media.media] == [conv.VIDEO_PLACEHOLDER] * 2
    assert media.units == [12, 4] and media.vision(dummy_tile=0) == (16, 16)


def test_a_dataset_cap_lowers_max_and_min_tiles() -> None:
    tiling = TilingConfig(mode="dynamic", min_tiles=2, max_tiles=12)
    assert dataset_tiling(tiling, None) is tiling
    capped = dataset_tiling(tiling, 1)
    assert (capped.min_tiles, capped.max_tiles) == (1, 1)
