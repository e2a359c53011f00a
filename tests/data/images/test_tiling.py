"""Image tiling against independent oracles: brute-force grid search, Hugging Face's LLaVA-NeXT."""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_omnibal.data.images.tiling import (
    DEFAULT_PINPOINTS,
    TilingConfig,
    anyres_resolution,
    dynamic_tiles,
    image_tiles,
)


def brute_force_internvl(width, height, tile, min_tiles, max_tiles, thumbnail):
    """InternVL's rule restated: among all grids of min..max tiles take those whose aspect ratio
    is nearest the image's; of these, the largest grid whose pixel area is under twice the
    image's area, or else the smallest grid; a thumbnail is added to multi-tile grids."""
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
             if min_tiles <= c * r <= max_tiles]
    if not grids:
        return 1
    diffs = {g: abs(width / height - g[0] / g[1]) for g in grids}
    nearest = min(diffs.values())
    ties = sorted((g for g in grids if diffs[g] == nearest), key=lambda g: (g[0] * g[1], g[0]))
    covered = [g for g in ties if width * height > 0.5 * tile * tile * g[0] * g[1]]
    # the loop keeps the first tie and moves on to later ties only while the area test holds
    chosen = covered[-1] if covered and covered[0] == ties[0] else ties[0]
    n = chosen[0] * chosen[1]
    return n + 1 if thumbnail and n > 1 else n


@pytest.mark.parametrize(("min_tiles", "max_tiles"), [(1, 12), (1, 6), (1, 1), (2, 9), (3, 4)])
def test_internvl_dynamic_tiles_match_brute_force(min_tiles, max_tiles):
    rng = np.random.default_rng(max_tiles * 10 + min_tiles)
    sizes = [tuple(map(int, s)) for s in rng.integers(1, 4000, (400, 2))]
    # exact aspect-ratio ties (1:1 vs 2:2, 2:1 vs 4:2, midway ratios) and small/large areas
    sizes += [(448, 448), (896, 896), (200, 200), (1344, 1344), (900, 450), (2000, 1000),
              (300, 150), (5, 4), (3, 2), (1920, 1080), (1, 3000), (3000, 1), (640, 480)]
    for (w, h), thumb in itertools.product(sizes, (True, False)):
        got = dynamic_tiles(w, h, 448, min_tiles, max_tiles, thumb)
        assert got == brute_force_internvl(w, h, 448, min_tiles, max_tiles, thumb), (w, h, thumb)


def test_internvl_known_cases():
    # 4:3 fits a 4x3 grid exactly: 12 tiles + thumbnail
    assert dynamic_tiles(800, 600, 448, 1, 12, True) == 13
    # 16:9 ties between 2x1 and 4x2; the image is large enough for 4x2 -> 8 + thumbnail
    assert dynamic_tiles(1920, 1080, 448, 1, 12, True) == 9
    # a small square image stays on one tile and gets no thumbnail
    assert dynamic_tiles(100, 100, 448, 1, 12, True) == 1
    # a 448x448 image ties 1x1 with 2x2 and 3x3 but is too small for them
    assert dynamic_tiles(448, 448, 448, 1, 12, True) == 1
    assert dynamic_tiles(1000, 1000, 448, 1, 12, True) == 10  # 3x3 + thumbnail


def test_multi_image_samples_share_the_tile_budget():
    cfg = TilingConfig(max_tiles=12)
    assert image_tiles(1920, 1080, cfg, 1) == (9, 9 * 256)
    # three images: at most 12 // 3 = 4 tiles each (2x2 or 4x1 etc.) plus thumbnail
    tiles, tokens = image_tiles(1920, 1080, cfg, 3)
    assert tiles == brute_force_internvl(1920, 1080, 448, 1, 4, True) == 3
    assert tokens == tiles * 256
    # more images than tiles: one tile each
    assert image_tiles(1920, 1080, cfg, 20) == (1, 256)
    # min_tiles above an image's share: InternVL has no grid left and uses one tile
    assert image_tiles(1920, 1080, TilingConfig(min_tiles=4, max_tiles=12), 6) == (1, 256)


def test_llava15_fixed_is_one_tile():
    cfg = TilingConfig(mode="fixed", tile=336, tokens_per_tile=576)
    for w, h in [(10, 3000), (336, 336), (4000, 3000)]:
        assert image_tiles(w, h, cfg, 1) == (1, 576)


def _hf_llava_next():
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    pinpoints = [list(p) for p in DEFAULT_PINPOINTS]
    unpadded = LlavaNextProcessor._get_unpadded_features
    proc = SimpleNamespace(
        image_processor=SimpleNamespace(image_grid_pinpoints=pinpoints),
        patch_size=14, num_additional_image_tokens=0,
        _get_unpadded_features=lambda *a: unpadded(None, *a))
    def tokens(h, w):
        return LlavaNextProcessor._get_number_of_features(proc, h, w, 336, 336)

    return select_best_resolution, pinpoints, tokens


def test_llava_next_anyres_matches_transformers():
    select_best_resolution, pinpoints, hf_tokens = _hf_llava_next()
    cfg = TilingConfig(mode="anyres", tile=336, tokens_per_tile=576)
    rng = np.random.default_rng(7)
    sizes = [tuple(map(int, s)) for s in rng.integers(1, 3000, (300, 2))]
    sizes += [(336, 336), (672, 336), (336, 672), (1000, 1000), (1, 2000), (2000, 1), (500, 333)]
    for w, h in sizes:
        best_h, best_w = select_best_resolution((h, w), pinpoints)
        assert anyres_resolution(w, h, DEFAULT_PINPOINTS) == (best_h, best_w), (w, h)
        tiles, tokens = image_tiles(w, h, cfg, 1)
        assert tiles == (best_h // 336) * (best_w // 336) + 1, (w, h)
        assert tokens == hf_tokens(h, w), (w, h)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="tiling mode"):
        TilingConfig(mode="tiles")
    with pytest.raises(ValueError, match="min_tiles <= max_tiles"):
        TilingConfig(min_tiles=5, max_tiles=2)
    with pytest.raises(ValueError, match="not a multiple of the tile"):
        TilingConfig(mode="anyres", tile=336, pinpoints=((336, 500),))
