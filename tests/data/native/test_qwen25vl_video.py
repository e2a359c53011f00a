"""Qwen2.5-VL videos (data.native_video, data.native_patches) against transformers' own Qwen2-VL
video processor code.

transformers' video processor module imports torchvision, which has no build for this CPU
torch, so its methods are taken from the installed source (`sample_frames`, `resize` up to the
pixel resampling, `patchify`, `smart_resize`) and run as they are: the frame count, the frame
size under the per-video pixel budget (`cap_pixels_per_frame`) and the patch layout are
transformers' own. The frames taken are qwen-vl-utils' (an even spread from the first to the
last frame, rounded), checked against its `torch.linspace(...).round()`. Videos of odd sizes
and rates are generated with PyAV; the oracle decodes every frame itself.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_omnibal.data.images.tiling import TilingConfig, TilingError
from megatron_omnibal.data.native.patches import frame_patches, video_to_patches
from megatron_omnibal.data.native.video import (
    NativeVideoError,
    NativeVideoSettings,
    native_video,
)
from megatron_omnibal.data.video.reader import VideoError
from tests.helpers.video_files import write_video

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.3, 0.25)


def transformers_video_rules(settings: NativeVideoSettings) -> object:
    """An object with transformers' Qwen2VLVideoProcessor `sample_frames`, `resize` (returning
    the size it would resample to) and `patchify`, built from the installed source."""
    import transformers
    from transformers.image_utils import SizeDict

    path = Path(transformers.__file__).parent / "models/qwen2_vl/video_processing_qwen2_vl.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef)
               and n.name == "Qwen2VLVideoProcessor")  # fmt: skip
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)
               and n.name in ("sample_frames", "resize", "patchify")]  # fmt: skip
    assert len(nodes) == 1 and len(methods) == 3, "transformers' video processor changed"
    for node in (*nodes, *methods):  # annotations name torchvision types
        for arg in (*node.args.args, *node.args.kwonlyargs):
            arg.annotation = None
        node.returns = None
    base = ast.parse("class Sized:\n    def resize(self, image, size, resample):\n"
                     "        return size.height, size.width\n").body[0]  # fmt: skip
    rules = ast.ClassDef(name="Rules", bases=[ast.Name("Sized", ast.Load())], keywords=[],
                         body=methods, decorator_list=[])  # fmt: skip
    module = ast.fix_missing_locations(ast.Module(body=[*nodes, base, rules], type_ignores=[]))
    space = {"math": math, "torch": torch, "SizeDict": SizeDict}
    exec(compile(module, str(path), "exec"), space)  # noqa: S102 - transformers' own code
    out = space["Rules"]()
    out.num_frames, out.fps, out.temporal_patch_size = None, settings.fps, 2
    out.min_frames, out.max_frames = settings.min_frames, settings.max_frames
    out.max_video_tokens = settings.max_video_tokens
    out.size = SizeDict(shortest_edge=settings.min_pixels, longest_edge=settings.max_pixels)
    return out


def _reference(rules, settings: NativeVideoSettings, frames: int, fps: float, width: int,
               height: int) -> tuple[list[int], tuple[int, int]]:
    """(frames taken as qwen-vl-utils picks them, size) by transformers' rules."""
    count = len(rules.sample_frames(SimpleNamespace(total_num_frames=frames, fps=fps)))
    # Its count is even; its float `arange` over the frames sometimes yields one index more
    # (765 frames at 23.976/s: 63 for 62), which qwen-vl-utils' linspace never does.
    count -= count % 2
    size = rules.resize(torch.zeros(1, count, 3, 1, 1).expand(1, count, 3, height, width),
                        rules.size, None, 28, 2, True)  # fmt: skip
    taken = torch.linspace(0, frames - 1, count).round().long().tolist()
    return taken, size


SETTINGS = [
    NativeVideoSettings(),
    NativeVideoSettings(fps=3.0, min_frames=2, max_frames=10, min_pixels=28 * 28 * 4,
                        max_pixels=28 * 28 * 40, max_video_tokens=300),
    NativeVideoSettings(fps=0.5, min_frames=6, max_frames=9, min_pixels=56 * 56,
                        max_pixels=28 * 28 * 1280, max_video_tokens=2000),
]  # fmt: skip


@pytest.mark.parametrize("settings", SETTINGS)
def test_frames_and_sizes_equal_transformers(settings: NativeVideoSettings) -> None:
    rules = transformers_video_rules(settings)
    rng = np.random.default_rng(0)
    cases = [(int(rng.integers(2, 900)), float(rng.choice([2, 7.5, 10, 23.976, 30, 60])),
              int(rng.integers(8, 2000)), int(rng.integers(8, 1200))) for _ in range(300)]
    cases += [(2, 1.0, 28, 28), (3, 30.0, 1999, 13), (768 * 4, 60.0, 1920, 1080)]
    for frames, fps, width, height in cases:
        if max(width, height) > 200 * min(width, height):
            with pytest.raises(TilingError):
                native_video(frames, fps, width, height, settings, 28, "v")
            continue
        taken, (h, w) = _reference(rules, settings, frames, fps, width, height)
        got = native_video(frames, fps, width, height, settings, 28, "v")
        case = (frames, fps, width, height)
        assert got.indices.tolist() == taken, case
        assert (got.height, got.width) == (h, w), case
        assert got.grid(14) == (len(taken) // 2, h // 14, w // 14)
        assert got.units == len(taken) // 2 * (h // 28) * (w // 28)
        assert got.seconds_per_grid == pytest.approx(2 / (len(taken) / frames * fps), rel=1e-12)


def test_an_odd_min_frames_rounds_up_as_qwen_vl_utils() -> None:
    """qwen-vl-utils rounds min_frames up to an even count (transformers does not: 5 of a
    5.3 s video at 0.5 frames/s are 4 frames there, 6 here)."""
    odd = NativeVideoSettings(fps=0.5, min_frames=5, max_frames=9)
    assert len(native_video(159, 30.0, 64, 48, odd, 28, "v").indices) == 6


def test_a_single_frame_video_is_refused() -> None:
    with pytest.raises(NativeVideoError, match="1 frame\\(s\\); Qwen2.5-VL takes at least 2"):
        native_video(1, 10.0, 64, 48, NativeVideoSettings(), 28, "a.mp4")


def test_frame_patches_equal_transformers_patchify() -> None:
    rules = transformers_video_rules(NativeVideoSettings())
    frames = np.random.default_rng(1).random((6, 3, 84, 140), dtype=np.float32)
    ref, t, h, w = rules.patchify(torch.from_numpy(frames)[None], 14, 2, 2)
    patches, grid = frame_patches(frames, 14, 2, 2)
    assert grid == (t, h, w) == (3, 6, 10)
    np.testing.assert_array_equal(patches, ref[0].numpy())
    with pytest.raises(ValueError, match="frames of 2"):
        frame_patches(frames[:5], 14, 2, 2)


def transformers_video(path: Path, clip: list[float] | None, settings: NativeVideoSettings
                       ) -> tuple[np.ndarray, list[int], float]:
    """(patches, grid, seconds per temporal patch) of a video: every frame decoded by PyAV,
    the clip's frames (InternVL's int(start x rate)) picked as qwen-vl-utils does with
    transformers' count, resized (PIL bicubic, as the image processor) to transformers' size,
    normalised with the settings' mean and std, patched by transformers."""
    import av

    with av.open(str(path)) as container:
        fps = float(container.streams.video[0].average_rate)
        every = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    first = int(clip[0] * fps) if clip else 0
    frames = min(int((clip[1] - clip[0]) * fps), len(every) - first) if clip else len(every)
    rules = transformers_video_rules(settings)
    height, width = every[0].shape[:2]
    taken, (h, w) = _reference(rules, settings, frames, fps, width, height)
    resized = np.stack([np.asarray(Image.fromarray(every[first + k]).resize(
        (w, h), Image.Resampling.BICUBIC)) for k in taken])  # fmt: skip
    mean, std = (np.array(v)[:, None, None] for v in (settings.image_mean, settings.image_std))
    pixels = (resized.transpose(0, 3, 1, 2) / 255.0 - mean) / std
    ref, *grid = rules.patchify(torch.from_numpy(pixels.astype(np.float32))[None], 14, 2, 2)
    return ref[0].numpy(), grid, 2 / (len(taken) / frames * fps)


@pytest.mark.parametrize(("size", "frames", "fps"), [((70, 46), 23, 10), ((36, 100), 9, 4)])
def test_video_patches_equal_transformers(tmp_path, size, frames, fps) -> None:
    """A generated video of odd size: the frames taken, decoded by seeking, resized (bicubic,
    as the image processor), normalised with the checkpoint's mean and std and patched, equal
    every frame decoded by PyAV, picked, resized and patched by transformers' code."""
    settings = NativeVideoSettings(fps=2.0, min_frames=4, max_frames=12, min_pixels=28 * 28 * 2,
                                   max_pixels=28 * 28 * 6, max_video_tokens=60,
                                   image_mean=MEAN, image_std=STD)  # fmt: skip
    path = write_video(tmp_path / "v.mp4", frames, fps=fps, size=size, gop=5)
    tiling = TilingConfig(mode="native", tile=28, tokens_per_tile=1, max_tiles=1)
    ref, grid, seconds = transformers_video(path, None, settings)
    video = native_video(frames, float(fps), *size, settings, 28, str(path))
    patches, got_grid, decoded = video_to_patches(path, 0, video, tiling, settings, 14, 2,
                                                  video.units, "v")  # fmt: skip
    assert list(got_grid) == grid and decoded >= len(video.indices)
    assert video.seconds_per_grid == pytest.approx(seconds, rel=1e-12)
    np.testing.assert_allclose(patches, ref, rtol=0, atol=1e-5)
    with pytest.raises(VideoError, match="v: .* merge groups from the video, the length file "
                                         "counts 1 "):  # fmt: skip
        video_to_patches(path, 0, video, tiling, settings, 14, 2, 1, "v")
