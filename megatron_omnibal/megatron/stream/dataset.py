"""Training samples from a real VLM dataset, exactly as `omnibal stats` measured them.

The balancer plans micro-batches from the length file (vit_num, token_num, image_flags per
sample); the samples it then draws must have exactly those lengths, or the balance (and the
planned memory) is fiction. So this source rebuilds what `omnibal stats` used from the
configuration stored in the length file: the record reader, the tiling, the chat template and
the tokenizer (image tokens added the same way, checked by fingerprint; a checkpoint's own chat
template checked by its hash). It renders each conversation through the same path as stats
(data/sample/text.py: any template stats accepts, the checkpoint's own included), spells out
tokens_per_tile image tokens per real tile, sets the loss on assistant answers only (the spans
the template gives) and compares every sample with its length record: a mismatch stops the run
naming the sample and both counts.

Only ranks that embed patches (`pixels=True`) open image files: they decode and tile them and
check the tile count against the length file. The other ranks take each image's tile count from
the length file (`image_tiles` for multi-image samples) and carry shape-only tiles.

A video sample trains on the frames its epoch planned (data/video_lengths.py: the count per
video follows from the balance seed and the epoch, the same on every rank); the prompt lists
them as transformers' InternVL processor does, one image per frame. Ranks that embed patches
decode exactly those frames (data/frames.py picks them, seeded by seed, epoch and sample),
seeking to them; each frame is resized to one tile (bicubic, no tiling, no thumbnail).

A native-resolution model (Qwen2.5-VL) gets each image whole as patches (data/native/patches.py:
its processor's resize, mean and std, patch order) with its grid (t, h, w), which every stage
needs (window order, rotary and M-RoPE positions): ranks that embed patches take it from the
decoded image, the others from the image's header (its size alone sets the grid), and both
check its merge groups against the length file. Its videos are whole too: the frames Qwen's rule
takes (data/native/video.py, the same every epoch), decoded by seeking to exactly those, resized
and normalised as its video processor does, patched two frames per temporal patch, with their
grid (t, h, w) and the seconds a temporal patch spans (the M-RoPE time step);
`<|vision_start|>` + `<|video_pad|>` x merge groups + `<|vision_end|>` in the text.
`open_source` checks the configuration, the sample count and a spread of records before
training starts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_omnibal.data.energon.members import MemberError
from megatron_omnibal.data.energon.source import EnergonOptions, EnergonSpec, changes, fingerprint
from megatron_omnibal.data.formats.raw import RawRecord, parse_record
from megatron_omnibal.data.formats.records import Video, read_sample
from megatron_omnibal.data.formats.sample_files import LoadedSample
from megatron_omnibal.data.frames import clip_start, frame_indices
from megatron_omnibal.data.images.header import ImageHeaderError
from megatron_omnibal.data.images.tiles import ImageDecodeError, image_to_tiles
from megatron_omnibal.data.images.tiling import TilingError
from megatron_omnibal.data.inputs import read_inputs
from megatron_omnibal.data.lengths import (
    ImageTiles,
    LengthsError,
    LengthStats,
    VideoTable,
    load_identities,
    load_image_tiles,
    read_stats_config,
)
from megatron_omnibal.data.native.patches import (
    check_units,
    image_to_patches,
    native_grid,
    video_to_patches,
)
from megatron_omnibal.data.native.qwen3_video import frame_indices as qwen3_frames
from megatron_omnibal.data.native.qwen3_video import take_video, timestamp_text, timestamps
from megatron_omnibal.data.sample.config import (
    StatsConfig,
    StatsConfigError,
    check_model,
    config_from_dict,
)
from megatron_omnibal.data.sample.media import SampleMedia, dataset_tiling, sample_media
from megatron_omnibal.data.sample.text import SampleText
from megatron_omnibal.data.text import conversations as conv
from megatron_omnibal.data.text.tokenization import TokenCounter
from megatron_omnibal.data.video.reader import VideoError, read_header
from megatron_omnibal.data.video.tiles import video_tiles
from megatron_omnibal.data.video_lengths import EpochLengths, load_video_plan
from megatron_omnibal.megatron.stream.node_plans import node_arrays
from megatron_omnibal.megatron.stream.record_index import RecordIndex
from megatron_omnibal.megatron.stream.source import SourceSettings

if TYPE_CHECKING:
    from megatron_omnibal.megatron.stream.batch import Sample

IGNORE_INDEX = -100  # the same value as batch.IGNORE_INDEX (batch.py imports torch)


class DatasetError(ValueError):
    """The dataset, its length file and the model disagree; the message names the sample."""


class RealSampleSource:
    """`source(index) -> Sample` for length record `index` of a real dataset."""

    def __init__(self, data: str | os.PathLike, config: StatsConfig, lengths: LengthStats,
                 spec: Any, image_tiles: ImageTiles, image_root: str | os.PathLike | None = None,
                 skipped: str | os.PathLike | None = None, pixels: bool = True,
                 by_epoch: EpochLengths | None = None, energon: dict | None = None,
                 identities: Callable[[], list[tuple[str, str]] | None] | None = None,
                 local_rank: int | None = None) -> None:
        tiling = config.tiling
        self.config = config
        self.lengths = lengths
        self.tokens_per_tile = spec.tokens_per_tile
        self.vocab_size = spec.llm.vocab_size
        self.image_token_id = spec.image_token_id
        self.image_tiles = image_tiles
        self.pixels = pixels
        self.native = tiling.mode == "native"
        v = spec.vit
        self.patch = (v.patch_size, v.temporal_patch_size, v.patch_dim) if self.native else None
        self.by_epoch = by_epoch or EpochLengths(lengths, VideoTable.empty(), None, 0)
        self.frames_decoded = self.frames_trained = 0  # video frames, by this process
        self.counter = TokenCounter(config.tokenizer, config.image_style,
                                    config.trust_remote_code)
        if self.counter.backend is None:
            raise DatasetError(f"{config.tokenizer}: training samples need a fast tokenizer "
                               "(token offsets locate the answers)")
        self.text = SampleText(config, self.counter)  # the template, as stats checked it
        self.context_id = self.counter.backend.token_to_id(config.image_style.context)
        video = conv.video_style(config.image_style) if self.native else None
        self.video_context_id = (self.counter.backend.token_to_id(video.context) if video
                                 else self.context_id)  # fmt: skip
        # Qwen3-VL: each temporal patch of a video between its own vision start and end ids
        self.timestamped = self.native and config.native_video.rule == "qwen3_vl"
        self.frame_marks = tuple(self.counter.backend.token_to_id(t) for t in
                                 (config.image_style.start, config.image_style.end))
        options = EnergonOptions(split=energon["split"], task_encoder=energon["task_encoder"]
                                 ) if energon else None
        self.specs, _ = read_inputs(data, image_root, options)
        _check_unchanged(self.specs, energon)
        self.files = [spec.files() for spec in self.specs]
        self.identities = identities  # read where the record index is built, not per rank
        self.tilings = [dataset_tiling(tiling, s.max_tiles) for s in self.specs]
        self.skipped = skipped
        self.entries = self._entries(_skipped_indices(skipped, self.specs), local_rank)

    def _entries(self, skipped: dict[str, set[int]], local_rank: int | None) -> RecordIndex:
        """(dataset, record) per length record, in the length file's order (record_index):
        built here, or with `local_rank` once per node (node_plans.node_arrays: local rank 0
        builds and checks it, the others map its arrays)."""
        if local_rank is None:
            entries = self._checked_index(skipped)
        else:
            key = {"data": [str(Path(s.annotation).resolve()) for s in self.specs],
                   "skipped": str(self.skipped), "records": len(self.lengths)}
            arrays, meta = node_arrays(lambda: self._checked_index(skipped).to_arrays(),
                                       "record-index", key, local_rank=local_rank)
            entries = RecordIndex.from_arrays(arrays, meta,
                                              lambda d: self.specs[d].record_table())
        if len(entries) != len(self.lengths):
            per_dataset = entries.per_dataset().tolist()
            detail = ", ".join(f"'{s.name}': {n}" for s, n in zip(self.specs, per_dataset,
                                                                   strict=True))
            report = (f"skipped report {self.skipped}" if skipped else
                      f"no skipped report at {self.skipped}" if self.skipped else
                      "no skipped report")
            raise DatasetError(
                f"the length file has {len(self.lengths)} samples, the dataset gives "
                f"{len(entries)} ({detail}; {report}): the length file was made from other "
                "data, or its skipped report is not next to it")
        return entries

    def _checked_index(self, skipped: dict[str, set[int]]) -> RecordIndex:
        """The record index built from the annotation files, each record checked against the
        identity the length file recorded for it (where it recorded them)."""
        entries = RecordIndex.build(
            [spec.record_table() for spec in self.specs], [spec.repeats for spec in self.specs],
            {d: skipped[spec.name] for d, spec in enumerate(self.specs) if spec.name in skipped})
        recorded = self.identities() if self.identities is not None else None
        if recorded is not None and len(entries) == len(self.lengths):
            moved = next((i for i, ((_, raw), want) in enumerate(zip(entries, recorded,
                                                                     strict=True))
                          if tuple(raw.data) != tuple(want)), None)
            if moved is not None:
                raise DatasetError(
                    f"length record {moved} is sample {'/'.join(recorded[moved])} in the "
                    f"length file, {'/'.join(entries[moved][1].data)} in the dataset: the "
                    "dataset changed since the length file was made; rerun `omnibal stats`")
        return entries

    def __len__(self) -> int:
        return len(self.entries)

    def describe(self, index: int) -> str:
        d, raw = self.entries[index]
        if isinstance(self.specs[d], EnergonSpec):
            shard, key = raw.data
            return (f"{self.specs[d].annotation}/{shard}/{key} (sample {raw.index} of "
                    f"'{self.specs[d].name}'), length record {index}")
        record_id = _record_id(raw)
        ident = f" (id {record_id})" if record_id is not None else ""
        return (f"{self.specs[d].annotation}:{raw.line}: sample {raw.index}{ident}, length "
                f"record {index}")

    def check(self, index: int, vit: int, tokens: int, flags: int, epoch: int = 0) -> None:
        """Stop with both counts when a sample is not what its length record (of `epoch`)
        says."""
        lengths = self.by_epoch(epoch)
        want = (int(lengths.vit[index]), int(lengths.tokens[index]),
                int(lengths.image_flags[index]))
        if (vit, tokens, flags) != want:
            raise DatasetError(
                f"{self.describe(index)}: the length file says vit_num={want[0]}, "
                f"token_num={want[1]}, image_flags={want[2]}; the dataset gives vit_num={vit}, "
                f"token_num={tokens}, image_flags={flags} (the length file was made from other "
                "data, tokenizer or `omnibal stats` flags)")

    def render(self, index: int, epoch: int = 0, sample: LoadedSample | None = None) -> tuple[
            np.ndarray, np.ndarray, list[str], SampleMedia, list[Video], LoadedSample]:
        """(token ids, loss flags per token, image names, its media (tiles per image, per frame
        of a video), videos, the loaded sample) of a sample as `epoch` trains it; `sample`: the
        sample already read (by another loader), else it is read here.

        Image placeholders are already expanded to the model's image token id. Tiles per image
        and frames per video come from the length file: no image is decoded here.
        """
        from megatron_omnibal.megatron.stream.loader import SampleLoadError

        if not 0 <= index < len(self.entries):
            raise IndexError(f"sample index {index} outside 0..{len(self.entries) - 1}")
        d, raw = self.entries[index]
        try:
            sample = sample or self.files[d].sample(raw)
            images, videos, turns = read_sample(sample.record, self.config.extra_keys)
        except MemberError as exc:
            raise SampleLoadError(f"{self.describe(index)}: {exc}") from exc
        except conv.SampleError as exc:
            raise DatasetError(f"{self.describe(index)}: {exc}") from exc
        tiles = self._tiles(index, len(images))
        # frames per video (a native video's merge groups) the length file plans for `epoch`
        units = self.frame_counts(index, epoch, len(videos)).tolist() if videos else []
        try:
            media = sample_media(self.config.image_style, self.native, tiles, units)
            chat = self.text.render(turns, media.media)
        except conv.SampleError as exc:
            raise DatasetError(f"{self.describe(index)}: {exc}") from exc
        ids, target = self.counter.encode_chat(chat)
        ids, target = self._expand(index, ids, target, media.units)
        if videos and self.timestamped:
            ids, target = self._timestamps(index, ids, target, media.units)
        return ids, target, images, media, videos, sample

    def _timestamps(self, index: int, ids: np.ndarray, target: np.ndarray,
                    units: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """A Qwen3-VL sample's videos as Qwen3VLProcessor writes them: each video's merge
        groups (in place, after `_expand`) cut into its temporal patches, each after the text
        `<t seconds>` and between its own vision start and end (data/native/qwen3_video.py);
        the frames and their times follow from the length file's frames and rate."""
        table, settings = self.by_epoch.table, self.config.native_video
        start, end = self.frame_marks
        pieces_ids, pieces_target, at = [], [], 0
        runs = np.flatnonzero(np.diff(np.r_[0, ids == self.image_token_id, 0]) == 1)
        for run, row, n in zip(runs, table.of_sample(index), units, strict=True):
            frames, fps = int(table.frames[row]), float(table.fps[row])
            stamps = timestamps(qwen3_frames(frames, fps, settings, self.describe(index)), fps,
                                settings.temporal_patch_size)
            per_patch = int(n) * self.tokens_per_tile // len(stamps)
            segment = []
            for seconds in stamps:
                text = self.counter.backend.encode(timestamp_text(seconds),
                                                   add_special_tokens=False).ids
                segment += [*text, start, *[self.image_token_id] * per_patch, end]
            pieces_ids += [ids[at:run], np.asarray(segment, np.int64)]
            pieces_target += [target[at:run], np.zeros(len(segment), bool)]
            at = run + int(n) * self.tokens_per_tile
        pieces_ids.append(ids[at:])
        pieces_target.append(target[at:])
        return np.concatenate(pieces_ids), np.concatenate(pieces_target)

    def frame_counts(self, index: int, epoch: int, n_videos: int) -> np.ndarray:
        """Frames each video of sample `index` trains on in `epoch` (from the epoch plan; a
        native-resolution model's: the merge groups of each video, the same every epoch)."""
        where = self.by_epoch.table.of_sample(index)
        if len(where) != n_videos:
            raise DatasetError(f"{self.describe(index)}: {n_videos} video(s), the length file "
                               f"lists {len(where)} for it; rerun `omnibal stats`")
        return self.by_epoch.frame_counts(epoch)[where]

    def _tiles(self, index: int, n_images: int) -> list[int]:
        """Each image's tiles as the length file counted them."""
        if n_images > 1:
            tiles = self.image_tiles.get(index)
            if tiles is None or len(tiles) != n_images:
                raise DatasetError(f"{self.describe(index)}: {n_images} images, but the length "
                                   f"file has no tiles for each of them ({tiles}); rerun "
                                   "`omnibal stats`")
            return list(tiles)
        return [int(self.lengths.image_flags[index])] if n_images else []

    def _expand(self, index: int, ids: np.ndarray, target: np.ndarray,
                tiles: list[int]) -> tuple[np.ndarray, np.ndarray]:
        context = (ids == self.context_id) | (ids == self.video_context_id)
        where = np.flatnonzero(context)
        if len(where) != len(tiles) or target[where].any():
            raise DatasetError(f"{self.describe(index)}: {len(where)} image context tokens in "
                               f"the text for {len(tiles)} image(s)")
        bad = np.flatnonzero((ids >= self.vocab_size) | (ids < 0) | (ids == self.image_token_id))
        bad = bad[~context[bad]]
        if bad.size:
            raise DatasetError(
                f"{self.describe(index)}: token id {int(ids[bad[0]])} is the model's image "
                f"token id or outside its vocabulary of {self.vocab_size} (tokenizer "
                f"{self.config.tokenizer} does not fit the model)")
        counts = np.ones(len(ids), np.int64)
        counts[where] = np.asarray(tiles, np.int64) * self.tokens_per_tile
        ids = np.where(context, self.image_token_id, ids)
        return np.repeat(ids, counts), np.repeat(target, counts)

    def measure(self, index: int, epoch: int = 0) -> tuple[int, int, int]:
        """(vit_num, token_num, image_flags) of a sample as built from its text."""
        ids, _, _, media, _, _ = self.render(index, epoch)
        vit, real = media.vision(self.config.dummy_tile)
        return vit, len(ids), real

    def __call__(self, index: int, epoch: int = 0, sample: LoadedSample | None = None
                 ) -> Sample:
        import torch

        from megatron_omnibal.megatron.stream.batch import Sample, shape_only_images
        from megatron_omnibal.megatron.stream.loader import SampleLoadError

        ids, target, names, media, videos, sample = self.render(index, epoch, sample)
        tiles = media.units
        vit, real = media.vision(self.config.dummy_tile)
        self.check(index, vit, len(ids), real, epoch)
        labels = np.full(len(ids), IGNORE_INDEX, np.int64)
        labels[:-1] = np.where(target[1:], ids[1:], IGNORE_INDEX)
        if self.native:
            seconds = [0.0] * len(names)
            if videos:
                images, grids, seconds = self.native_videos(index, videos, tiles, sample)
            else:
                images, grids = self.native_images(index, names, tiles, sample)
            return Sample(tokens=torch.from_numpy(ids), labels=torch.from_numpy(labels),
                          images=images, image_flags=torch.ones(len(grids), dtype=torch.int64),
                          image_grid=torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
                          grid_seconds=torch.tensor(seconds, dtype=torch.float32))
        size = self.config.tiling.tile
        if not self.pixels:
            images = shape_only_images(vit, size)
        elif videos:
            try:
                images = torch.from_numpy(self.video_tiles(index, epoch, videos, sample))
            except VideoError as exc:
                raise SampleLoadError(f"{self.describe(index)}: {exc}") from exc
        elif names:
            tiling = self.tilings[self.entries[index][0]]
            try:
                images = torch.from_numpy(np.concatenate([
                    image_to_tiles(sample.decode(n), tiling, len(names), t, sample.where(n))
                    for n, t in zip(names, tiles, strict=True)]))
            except ImageDecodeError as exc:
                raise SampleLoadError(f"{self.describe(index)}: {exc}") from exc
        else:
            images = torch.zeros((vit, 3, size, size), dtype=torch.float32)
        flags = np.zeros(vit, np.int64)
        flags[:real] = 1
        return Sample(tokens=torch.from_numpy(ids), labels=torch.from_numpy(labels),
                      images=images, image_flags=torch.from_numpy(flags))

    def native_images(self, index: int, names: list[str], units: list[int],
                      sample: LoadedSample) -> tuple[Any, list[tuple[int, int, int]]]:
        """(patches [patches, patch values], grids (t, h, w)) of a native-resolution sample's
        images; shape-only patches, the grids from the images' headers, without `pixels`."""
        import torch

        from megatron_omnibal.megatron.stream.loader import SampleLoadError

        patch, temporal, dim = self.patch
        tiling = self.tilings[self.entries[index][0]]
        parts, grids = [], []
        try:
            for name, expected in zip(names, units, strict=True):
                where = sample.where(name)
                if self.pixels:
                    patches, grid = image_to_patches(sample.decode(name), tiling, patch,
                                                     temporal, expected, where)
                    parts.append(patches)
                else:
                    width, height = sample.image_size(name)
                    grid = native_grid(width, height, tiling, patch)
                    merge = tiling.tile // patch
                    check_units(grid[1] * grid[2] // (merge * merge), expected, width, height,
                                where)
                grids.append(grid)
        except (ImageDecodeError, ImageHeaderError, TilingError, MemberError) as exc:
            raise SampleLoadError(f"{self.describe(index)}: {exc}") from exc
        if parts:
            return torch.from_numpy(np.concatenate(parts)), grids
        total = sum(t * h * w for t, h, w in grids)
        return torch.zeros((), dtype=torch.float32).expand(total, dim), grids

    def native_videos(self, index: int, videos: list[Video], units: list[int],
                      sample: LoadedSample) -> tuple[Any, list[tuple[int, int, int]], list[float]]:
        """(patches, grids (t, h, w), seconds per temporal patch) of a native-resolution
        sample's videos (data/native/video.py: the frames, their size); without `pixels`
        shape-only patches, the grids from the videos' headers."""
        import torch

        from megatron_omnibal.megatron.stream.loader import SampleLoadError

        patch, temporal, dim = self.patch
        table, settings = self.by_epoch.table, self.config.native_video
        tiling = self.config.tiling
        parts, grids, seconds = [], [], []
        try:
            for video, row, expected in zip(videos, table.of_sample(index), units, strict=True):
                path = sample.video_path(video.path)
                frames, fps = int(table.frames[row]), float(table.fps[row])
                header = read_header(path)
                taken = take_video(frames, fps, header.width, header.height, settings,
                                   tiling.tile, path)
                if self.pixels:
                    patches, _, decoded = video_to_patches(
                        path, clip_start(video.clip, fps), taken, tiling, settings, patch,
                        temporal, int(expected), path)
                    parts.append(patches)
                    self.frames_decoded += decoded
                    self.frames_trained += len(taken.indices)
                elif taken.units != expected:
                    raise VideoError(f"{path}: {taken.units} merge groups from the video, the "
                                     f"length file counts {expected} (the video changed since "
                                     "`omnibal stats`)")
                t, h, w = taken.grid(patch)
                split = self.timestamped  # Qwen3-VL: one (1, h, w) grid per temporal patch
                grids += [(1, h, w)] * t if split else [(t, h, w)]
                seconds += [taken.seconds_per_grid] * (t if split else 1)
        except (VideoError, TilingError, MemberError) as exc:
            raise SampleLoadError(f"{self.describe(index)}: {exc}") from exc
        if parts:
            return torch.from_numpy(np.concatenate(parts)), grids, seconds
        total = sum(t * h * w for t, h, w in grids)
        return torch.zeros((), dtype=torch.float32).expand(total, dim), grids, seconds

    def video_tiles(self, index: int, epoch: int, videos: list[Video],
                    sample: LoadedSample) -> np.ndarray:
        """float32 [frames, 3, tile, tile]: the planned frames of each video of a sample,
        decoded exactly and resized to one tile each (data/video/tiles.py)."""
        table = self.by_epoch.table
        counts = self.frame_counts(index, epoch, len(videos))
        out = []
        for video, row, count in zip(videos, table.of_sample(index), counts, strict=True):
            path = sample.video_path(video.path)
            frames, fps = int(table.frames[row]), float(table.fps[row])
            picked = clip_start(video.clip, fps) + frame_indices(
                self.by_epoch.plan.frames, int(count), frames, fps, self.by_epoch.seed, epoch,
                index, int(row))
            tiles, decoded = video_tiles(path, picked, self.config.tiling)
            self.frames_decoded += decoded
            self.frames_trained += len(picked)
            out.append(tiles)
        return np.concatenate(out)

    def check_spread(self, count: int) -> None:
        """Build `count` records spread over the dataset (the first and last included) from
        their text and compare them with the length file (no image is opened)."""
        if count <= 0 or not len(self):
            return
        for index in np.unique(np.linspace(0, len(self) - 1, count).round().astype(np.int64)):
            self.check(int(index), *self.measure(int(index)))


def _record_id(raw: RawRecord) -> str | None:
    try:
        value = parse_record(raw).get("id")
    except conv.SampleError:
        return None
    return None if value is None else str(value)


def _skipped_indices(path: str | os.PathLike | None, specs: list) -> dict[str, set[int]]:
    """Annotation indices per dataset that `omnibal stats --on-error skip` left out."""
    if path is None or not Path(path).is_file():
        return {}
    try:
        report = json.loads(Path(path).read_text())
        datasets = report["datasets"]
        out = {name: {int(s["index"]) for s in entry["skipped"]}
               for name, entry in datasets.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DatasetError(f"{path}: not a skipped report of `omnibal stats` ({exc})") from exc
    unknown = set(out) - {s.name for s in specs}
    if unknown:
        raise DatasetError(f"{path}: skipped report names dataset(s) {sorted(unknown)} that "
                           "the dataset does not have")
    return out


def _check_unchanged(specs: list, energon: dict | None) -> None:
    """Refuse Energon datasets that changed since the length file was made, saying what."""
    if not energon:
        return
    stored = energon["datasets"]
    now = [s for s in specs if isinstance(s, EnergonSpec)]
    if len(stored) != len(now):
        raise DatasetError(f"the length file was made from {len(stored)} Energon dataset(s) "
                           f"{[d['name'] for d in stored]}, the data names {len(now)}")
    for spec, before in zip(now, stored, strict=True):  # in order: a moved folder is the same
        found = changes(before, fingerprint(spec))
        if found:
            raise DatasetError(f"Energon dataset '{spec.name}' ({spec.annotation}) changed "
                               f"since the length file was made: {'; '.join(found)}; rerun "
                               "`omnibal stats`")


def stored_config(lengths_path: str | os.PathLike) -> tuple[StatsConfig, dict]:
    """The configuration `omnibal stats` stored in the length file, and its run facts."""
    try:
        doc = read_stats_config(lengths_path)
    except (OSError, ValueError) as exc:
        raise DatasetError(f"--omnibal-lengths {lengths_path}: {exc}") from exc
    if doc is None:
        raise DatasetError(
            f"--omnibal-lengths {lengths_path} holds no stats configuration: a real dataset "
            "trains only from a length file that `omnibal stats --model` wrote (.npz or its "
            "meta .json), which says how the data was tiled, templated and tokenized")
    try:
        return config_from_dict(doc, f"--omnibal-lengths {lengths_path}")
    except StatsConfigError as exc:
        raise DatasetError(str(exc)) from exc


def open_source(source: SourceSettings, lengths: LengthStats, spec: Any, pixels: bool = True,
                check: int = 32, by_epoch: EpochLengths | None = None,
                local_rank: int | None = None) -> RealSampleSource:
    """The dataset of --omnibal-data PATH, checked against --omnibal-lengths and the model (no
    process group). `check` records spread over the dataset are built now, every sample
    again when drawn. `pixels`: this rank decodes images (its stage embeds patches; a source
    opened without may be switched on later by setting its `pixels`).
    `by_epoch`: the run's lengths per epoch (default: the epochs of the frame seed the length
    file was counted with, whose epoch 0 is the file's own records). `local_rank`: every
    local rank of the node opens the source now, so its record index is built once per node
    (None: built here)."""
    where = f"--omnibal-lengths {source.lengths_path}"
    if source.text_scale != 1:
        raise DatasetError(f"--omnibal-text-scale {source.text_scale}: with a real "
                           "dataset the length file is used as it is (the scale is for "
                           "synthetic dry runs)")
    config, run = stored_config(source.lengths_path)
    try:
        check_model(config, run, spec, where)
    except StatsConfigError as exc:
        raise DatasetError(str(exc)) from exc
    if source.tokenizer:
        config = replace(config, tokenizer=source.tokenizer)
    config = replace(config, trust_remote_code=source.trust_remote_code)
    report = Path(source.lengths_path)
    try:
        tiles = load_image_tiles(source.lengths_path)
        if by_epoch is None:
            table, plan = load_video_plan(source.lengths_path)
            by_epoch = EpochLengths(lengths, table, plan, plan.seed if plan else 0)
        opened = RealSampleSource(
            source.data, config, lengths, spec, tiles, run.get("image_root"),
            skipped=report.with_name(f"{report.stem}.skipped.json"), pixels=pixels,
            by_epoch=by_epoch, energon=run.get("energon"),
            identities=partial(load_identities, source.lengths_path), local_rank=local_rank)
    except (OSError, LengthsError) as exc:  # a missing dataset, annotation or tokenizer
        raise DatasetError(f"--omnibal-data {source.data}: {exc}") from exc
    except ValueError as exc:  # a tokenizer that cannot be loaded (the message says why)
        raise DatasetError(f"{where}: {exc}") from exc
    fingerprint = opened.counter.fingerprint()
    if fingerprint != run.get("tokenizer_fingerprint"):
        raise DatasetError(
            f"tokenizer {config.tokenizer} is not the one {where} was counted with (fingerprint "
            f"{fingerprint}, stored {run.get('tokenizer_fingerprint')}); give the same "
            "tokenizer with --omnibal-tokenizer or rerun `omnibal stats`")
    sha, stored = opened.text.template_sha, run.get("chat_template_sha")
    if sha is not None and stored is not None and sha != stored:
        raise DatasetError(
            f"tokenizer {config.tokenizer} has another chat template (sha {sha}) than the one "
            f"{where} was counted with (sha {stored}); give the same tokenizer with "
            "--omnibal-tokenizer or rerun `omnibal stats`")
    opened.check_spread(check)
    return opened
