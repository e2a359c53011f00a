"""Length statistics of a real VLM dataset, computed the way the model will see it.

For every sample: `vit_num` (image tiles the vision encoder runs, a text-only sample's dummy tile
included), `image_flags` (the real tiles) and `token_num` (tokens of the whole conversation after
the chat template, image placeholders expanded to the image tokens). Images are measured from
their headers (or fully decoded, with `verify_images`) and tokens counted with the model's
tokenizer, in worker processes. The configuration is stored with the lengths (stats_config.py).

A sample that cannot be measured (missing or corrupt image, bad conversation, more tokens than
`max_tokens`) stops the run (`on_error="error"`) or is left out of the length file and listed in
the skipped report (`on_error="skip"`): never dropped silently. The length file then holds the
remaining samples in dataset order, so the training loader must drop the listed samples too.

Videos are measured from their container headers (frames available, frame rate; with
`verify_images` the frames they can give are decoded too). A Qwen2.5-VL video follows its own
rule (data/native/video.py: frames at a fixed rate, sized within a per-video pixel budget), the
same in every epoch: its merge groups are its tiles and its tokens. For InternVL, each frame
is one tile and one image's tokens; the records hold the frame counts of epoch 0 of
`frame_seed` (drawn over the whole video table, data/frames.py), and the video table and
per-frame token costs let training recompute every other epoch (data/video_lengths.py); such a
video sample is over-long when its largest frame count would pass `max_tokens`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from megatron_omnibal.data.energon.source import EnergonOptions, EnergonSpec, fingerprint
from megatron_omnibal.data.formats.annotations import DatasetSpec, chunks, read_records
from megatron_omnibal.data.formats.raw import RawRecord
from megatron_omnibal.data.formats.records import Video, read_sample
from megatron_omnibal.data.formats.sample_files import LoadedSample
from megatron_omnibal.data.frames import FrameSettings, clip_start, frame_counts, frame_indices
from megatron_omnibal.data.images.header import ImageHeaderError
from megatron_omnibal.data.images.tiles import ImageDecodeError
from megatron_omnibal.data.images.tiling import TilingConfig, TilingError, image_tiles
from megatron_omnibal.data.inputs import read_inputs
from megatron_omnibal.data.lengths import (
    ImageTiles,
    LengthStats,
    VideoTable,
    concat,
    concat_videos,
    from_arrays,
    save_lengths,
)
from megatron_omnibal.data.native.qwen3_video import take_video, timestamp_text
from megatron_omnibal.data.native.video import NativeVideo
from megatron_omnibal.data.sample.config import StatsConfig, config_to_dict
from megatron_omnibal.data.sample.media import SampleMedia, dataset_tiling, sample_media
from megatron_omnibal.data.sample.text import SampleText
from megatron_omnibal.data.text import conversations as conv
from megatron_omnibal.data.text.tokenization import TokenCounter
from megatron_omnibal.data.video.reader import (
    VideoError,
    VideoHeader,
    count_frames,
    decode_frames,
    read_header,
)
from megatron_omnibal.data.video_lengths import VideoPlan, with_frame_counts

ON_ERROR = ("error", "skip")


class StatsError(ValueError):
    """Samples that could not be measured, under on_error="error"; names file, line and id."""


@dataclass(frozen=True)
class Skipped:
    """A sample left out of the length file, and why."""

    dataset: str
    index: int  # position in the annotation file (0-based)
    line: int  # 1-based line in the annotation file
    id: str | None
    reason: str


@dataclass
class StatsResult:
    """Per-dataset statistics (input order), the skipped samples and how long it took."""

    specs: list[DatasetSpec]
    datasets: list[LengthStats]
    skipped: list[Skipped]
    records: list[int]  # annotation records read per dataset
    seconds: float
    is_meta: bool
    added_tokens: list[str]
    image_tiles: list[ImageTiles]  # per dataset: tiles of each image of multi-image samples
    config: dict  # the stored configuration (stats_config.config_to_dict)
    videos: list[VideoTable]  # per dataset (its own sample indices)
    # per dataset: (shard, key) of each length entry of an Energon dataset, else None
    identities: list[list[tuple[str, str]] | None]

    @property
    def stats(self) -> LengthStats:
        return concat(self.datasets)


@dataclass
class _ChunkOut:
    dataset: int
    vit: np.ndarray
    tokens: np.ndarray
    flags: np.ndarray
    ok: np.ndarray
    errors: list[Skipped]
    multi: dict[int, tuple[int, ...]]  # chunk position -> tiles per image (2+ images)
    # chunk position -> (frames, fps, tiles counted) per video
    videos: dict[int, list[tuple[int, float, int]]]


_STATE: dict = {}


def compute_stats(path: str | os.PathLike, config: StatsConfig,
                  image_root: str | os.PathLike | None = None, on_error: str = "error",
                  workers: int = 1, chunk_size: int = 256,
                  progress: bool = True, energon: EnergonOptions | None = None) -> StatsResult:
    """Length statistics of the dataset(s) at `path` (JSON list, JSONL, InternVL meta, or a
    Megatron-Energon dataset read with `energon`)."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    start = time.perf_counter()
    specs, is_meta = read_inputs(path, image_root, energon)
    config = replace(config, tokenizer=str(Path(config.tokenizer).resolve()))
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    if workers > 1:
        # Worker processes are the parallelism; the tokenizer's own thread pool would not
        # survive the fork (and would oversubscribe the cores). Restored when done.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return _compute(specs, is_meta, config, on_error, workers, chunk_size, progress, start,
                        image_root)
    finally:
        _STATE.clear()
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _compute(specs: list[DatasetSpec], is_meta: bool, config: StatsConfig, on_error: str,
             workers: int, chunk_size: int, progress: bool, start: float,
             image_root: str | os.PathLike | None) -> StatsResult:
    counter = TokenCounter(config.tokenizer, config.image_style, config.trust_remote_code)
    plan = video_plan(config, counter)
    text = SampleText(config, counter)  # a template that cannot train stops here
    _STATE.update(config=config, counter=counter, plan=plan, text=text)
    records = [read_records(spec) for spec in specs]
    total = sum(len(r) for r in records)
    tasks = _tasks(specs, records, config, chunk_size)
    outs: list[_ChunkOut] = []
    skipped: list[Skipped] = []
    from tqdm import tqdm

    bar = tqdm(total=total, unit="sample", desc="omnibal stats", disable=not progress,
               file=sys.stderr, dynamic_ncols=True, smoothing=0.05, delay=1.0)
    pool = mp.get_context("fork").Pool(workers, _ignore_interrupt) if workers > 1 else None
    try:
        results = pool.imap(_run_chunk, tasks) if pool else map(_run_chunk, tasks)
        for out in results:
            if out.errors and on_error == "error":
                raise StatsError(_error_message(out.errors, specs))
            skipped.extend(out.errors)
            outs.append(out)
            bar.update(len(out.ok))
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    datasets, multi, videos, identities = [], [], [], []
    for d, spec in enumerate(specs):
        mine = [o for o in outs if o.dataset == d]
        keep = np.concatenate([o.ok for o in mine]) if mine else np.zeros(0, bool)
        arrays = [np.concatenate([getattr(o, f) for o in mine])[keep] if mine
                  else np.zeros(0, np.int64) for f in ("vit", "tokens", "flags")]
        n_skipped = sum(len(o.errors) for o in mine)
        if int(keep.sum()) + n_skipped != len(records[d]):
            raise RuntimeError(f"{spec.annotation}: {int(keep.sum())} measured + {n_skipped} "
                               f"skipped != {len(records[d])} records")
        repeat = spec.repeats
        vit, tokens, flags = (np.tile(a, repeat) for a in arrays)
        datasets.append(from_arrays(vit, tokens, flags, names=(spec.name,),
                                    source=str(spec.annotation)))
        multi.append(_kept_image_tiles(mine, keep, repeat))
        identities.append([r.data for r, k in zip(records[d], keep, strict=True) if k] * repeat
                          if isinstance(spec, EnergonSpec) else None)
        videos.append(_kept_videos(mine, keep, repeat))
    if config.tiling.mode != "native":  # Qwen2.5-VL's videos are the same every epoch
        datasets, videos = _first_epoch_frames(datasets, videos, plan, config.frame_seed)
    stored = _stored_config(config, counter, specs, is_meta, image_root)
    if text.template_sha is not None:
        stored["chat_template_sha"] = text.template_sha
    stored["frame_tokens"] = list(plan.frame_tokens)
    return StatsResult(specs, datasets, skipped, [len(r) for r in records],
                       time.perf_counter() - start, is_meta, counter.added, multi, stored,
                       videos, identities)


def video_plan(config: StatsConfig, counter: TokenCounter) -> VideoPlan:
    """The frame settings and what frame k of a video adds in tokens: its label (between two
    images' end and start tokens it is tokenized on its own), the image marks, the image."""
    style = config.image_style
    per_image = config.tiling.tokens_per_tile + bool(style.start) + bool(style.end)
    labels = counter.count([conv.frame_label(k) for k in range(1, config.frames.max_frames + 1)])
    return VideoPlan(frames=config.frames, frame_tokens=tuple(n + per_image for n in labels),
                     seed=config.frame_seed)


def _kept_videos(outs: list[_ChunkOut], keep: np.ndarray, repeat: int) -> VideoTable:
    """The videos of the kept records (one frame counted each), by length-file position."""
    position = np.cumsum(keep) - 1
    rows, start = [], 0
    for out in outs:
        rows.extend((int(position[start + k]), *row) for k, found in sorted(out.videos.items())
                    for row in found)
        start += len(out.ok)
    sample = np.asarray([r[0] for r in rows], np.int64)
    frames = np.asarray([r[1] for r in rows], np.int64)
    fps = np.asarray([r[2] for r in rows], np.float64)
    tiles = np.asarray([r[3] for r in rows], np.int64)
    kept = int(keep.sum())
    return VideoTable(np.concatenate([sample + r * kept for r in range(repeat)]),
                      np.tile(frames, repeat), np.tile(fps, repeat), np.tile(tiles, repeat))


def _first_epoch_frames(datasets: list[LengthStats], videos: list[VideoTable], plan: VideoPlan,
                        seed: int) -> tuple[list[LengthStats], list[VideoTable]]:
    """The records with each video's frames of epoch 0 of `seed` (drawn over all datasets'
    videos in order, as training draws them) in place of the one frame measured."""
    offsets = np.cumsum([0, *(len(d) for d in datasets)])
    whole = concat_videos(v.shifted(int(o)) for v, o in zip(videos, offsets, strict=False))
    counts = frame_counts(plan.frames, whole.frames, whole.fps, seed, 0)
    out_sets, out_videos, first = [], [], 0
    for stats, table in zip(datasets, videos, strict=True):
        mine = counts[first:first + len(table)]
        first += len(table)
        out_sets.append(with_frame_counts(stats, table, plan, mine))
        out_videos.append(VideoTable(table.sample, table.frames, table.fps, mine))
    return out_sets, out_videos


def _kept_image_tiles(outs: list[_ChunkOut], keep: np.ndarray, repeat: int) -> ImageTiles:
    """Per-image tiles of the multi-image samples, by position in the (repeated) length file."""
    position = np.cumsum(keep) - 1  # record position -> length entry (kept records only)
    found: ImageTiles = {}
    start = 0
    for out in outs:
        for k, tiles in out.multi.items():
            found[int(position[start + k])] = tiles
        start += len(out.ok)
    kept = int(keep.sum())
    return {i + r * kept: t for r in range(repeat) for i, t in found.items()}


def _stored_config(config: StatsConfig, counter: TokenCounter, specs: list[DatasetSpec],
                   is_meta: bool, image_root: str | os.PathLike | None) -> dict:
    style = config.image_style
    ids = {part: counter.token_id(getattr(style, part)) if getattr(style, part) else None
           for part in ("start", "context", "end")}
    root = None if is_meta or image_root is None else str(Path(image_root).resolve())
    run = {
        "tokenizer_fingerprint": counter.fingerprint(),
        "added_tokens": list(counter.added),
        "image_token_ids": ids,
        "image_root": root,
        "datasets": [s.name for s in specs],
    }
    energon = [s for s in specs if isinstance(s, EnergonSpec)]
    if energon:
        run["energon"] = {"split": energon[0].split, "task_encoder": energon[0].task_encoder,
                          "datasets": [fingerprint(s) for s in energon]}
    return config_to_dict(config, run)


def _tasks(specs: list[DatasetSpec], records: list[list[RawRecord]], config: StatsConfig,
           chunk_size: int) -> Iterator[tuple]:
    for d, (spec, recs) in enumerate(zip(specs, records, strict=True)):
        tiling = dataset_tiling(config.tiling, spec.max_tiles)
        for chunk in chunks(recs, chunk_size):
            yield d, spec.name, spec.files(), tiling, chunk


def _ignore_interrupt() -> None:
    """Workers leave Ctrl-C (sent to the whole process group) to the parent, which stops them:
    one "interrupted" line instead of a traceback per worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_chunk(task: tuple) -> _ChunkOut:
    """Measure one chunk of records (in a worker): images per sample, then one token batch."""
    dataset, name, files, tiling, chunk = task
    config: StatsConfig = _STATE["config"]
    counter: TokenCounter = _STATE["counter"]
    n = len(chunk)
    vit = np.zeros(n, np.int64)
    flags = np.zeros(n, np.int64)
    tokens = np.zeros(n, np.int64)
    ok = np.ones(n, bool)
    errors: list[Skipped] = []
    texts: list[str] = []
    owner: list[int] = []
    multi: dict[int, tuple[int, ...]] = {}
    videos: dict[int, list[tuple[int, float, int]]] = {}
    most = np.zeros(n, np.int64)  # tokens the videos add at their largest frame counts
    plan: VideoPlan = _STATE["plan"]
    ids: list[str | None] = [None] * n
    for k, raw in enumerate(chunk):
        try:
            sample = files.sample(raw)
            ids[k] = _sample_id(sample.record)
            pieces, extra, media, found = _measure(sample, tiling, config, counter,
                                                   _STATE["text"])
        except (conv.SampleError, ImageHeaderError, ImageDecodeError, VideoError) as exc:
            ok[k] = False
            errors.append(Skipped(name, raw.index, raw.line, ids[k], str(exc)))
            continue
        tokens[k] = extra
        # InternVL: one frame per video (see _first_epoch_frames); Qwen2.5-VL: its merge groups
        vit[k], flags[k] = media.vision(config.dummy_tile)
        if not found and len(media.units) > 1:
            multi[k] = tuple(media.units)
        if found:
            videos[k] = found
        if found and tiling.mode != "native":
            largest = [_largest_count(config.frames, f, r) for f, r, _ in found]
            most[k] = int((plan.video_tokens(np.asarray(largest)) - plan.video_tokens(
                np.ones(len(found), np.int64))).sum())
        texts.extend(pieces)
        owner.extend([k] * len(pieces))
    if texts:
        np.add.at(tokens, np.asarray(owner), np.asarray(counter.count(texts), np.int64))
    if config.max_tokens is not None:
        for k in np.flatnonzero(ok & (tokens + most > config.max_tokens)):
            ok[k] = False
            raw = chunk[k]
            frames = " with its videos' most frames" if most[k] else ""
            errors.append(Skipped(name, raw.index, raw.line, ids[k],
                                  f"over-long: {int(tokens[k] + most[k])} tokens{frames} > "
                                  f"--max-tokens {config.max_tokens}"))
    errors.sort(key=lambda e: e.index)
    return _ChunkOut(dataset, vit, tokens, flags, ok, errors,
                     {k: t for k, t in multi.items() if ok[k]},
                     {k: v for k, v in videos.items() if ok[k]})


def _largest_count(frames: FrameSettings, available: int, fps: float) -> int:
    """The most frames a video of `available` frames at `fps` can train on, in any epoch."""
    if frames.fps is None:
        return frames.max_frames
    return int(frame_counts(frames, np.array([available]), np.array([fps]), 0, 0)[0])


def _sample_id(record: dict) -> str | None:
    value = record.get("id")
    return None if value is None else str(value)


def _measure(sample: LoadedSample, tiling: TilingConfig, config: StatsConfig,
             counter: TokenCounter, text: SampleText
             ) -> tuple[list[str], int, SampleMedia, list[tuple[int, float, int]]]:
    """(text pieces, image tokens beyond one per image, its media (tiles of each image),
    (frames, fps, tiles) of each video) of a sample; an InternVL video is rendered with one
    frame, a Qwen2.5-VL video whole."""
    images, videos, turns = read_sample(sample.record, config.extra_keys)
    native = tiling.mode == "native"
    extra = 0
    if videos and native:
        taken = [native_video_of(sample.video_path(v.path), v, config) for v in videos]
        found = [row for row, _ in taken]
        extra += sum(units - 1 for *_, units in found)
        extra += sum(timestamp_tokens(video, counter) for _, video in taken)
    elif videos:
        found = [(*video_frames(sample.video_path(v.path), v, config), 1) for v in videos]
        extra += len(videos) * (config.tiling.tokens_per_tile - 1)
    else:
        found = []
    per_image = []
    for rel in images:
        width, height = sample.image_size(rel)
        if config.verify_images:
            decoded = sample.decode(rel).size
            if decoded != (width, height):
                raise ImageDecodeError(f"image {sample.where(rel)}: the header says "
                                       f"{width}x{height}, the decoded image is "
                                       f"{decoded[0]}x{decoded[1]}")
        try:
            n_tiles, n_tokens = image_tiles(width, height, tiling, len(images))
        except TilingError as exc:
            raise conv.SampleError(f"image {sample.where(rel)}: {exc}") from None
        per_image.append(n_tiles)
        extra += n_tokens - 1
    media = sample_media(config.image_style, native, per_image, [units for *_, units in found])
    chat = text.render(turns, media.media)
    if chat.specials:
        extra += counter.specials
    return chat.pieces, extra, media, found


def native_video_of(path: str, video: Video, config: StatsConfig
                    ) -> tuple[tuple[int, float, int], NativeVideo]:
    """((frames available, frame rate, merge groups), what the model takes) of a video as
    Qwen2.5-VL (or Qwen3-VL) takes it, from its header; with `verify_images` the frames it
    takes are decoded too (and the frames a container without a stored count has are counted
    by decoding)."""
    header = read_header(path)
    first, frames = clip_frames(available_frames(path, header, config), header.fps,
                                video.clip, path)
    try:
        taken = take_video(frames, header.fps, header.width, header.height,
                           config.native_video, config.tiling.tile, path)
    except TilingError as exc:
        raise conv.SampleError(f"video {path}: {exc}") from None
    if config.verify_images:
        decode_frames(path, first + taken.indices)
    return (frames, header.fps, taken.units), taken


def timestamp_tokens(video: NativeVideo, counter: TokenCounter) -> int:
    """Tokens a Qwen3-VL video adds around its merge groups: each temporal patch's timestamp
    text and its own `<|vision_start|>` and `<|vision_end|>` (none for Qwen2.5-VL's)."""
    if not video.timestamps:
        return 0
    texts = counter.count([timestamp_text(t) for t in video.timestamps])
    return sum(texts) + 2 * len(video.timestamps)


def video_frames(path: str, video: Video, config: StatsConfig) -> tuple[int, float]:
    """(frames available, frame rate) of a video (of its clip, if it has one), from its header;
    with `verify_images` the frames it can give are decoded too (and the frames a container
    without a stored count has are counted by decoding)."""
    header = read_header(path)
    first, frames = clip_frames(available_frames(path, header, config), header.fps,
                                video.clip, path)
    if config.verify_images:
        spread = frame_indices(FrameSettings(min_frames=1, max_frames=config.frames.max_frames,
                                             sampling="middle"),
                               min(frames, config.frames.max_frames), frames, header.fps,
                               seed=0, epoch=0, sample=0, video=0)
        decode_frames(path, sorted({*(first + spread).tolist(), first + frames - 1}))
    return frames, header.fps


def available_frames(path: str, header: VideoHeader, config: StatsConfig) -> int:
    """The frames a video has: its header's count, or with `verify_images`, where the
    container stores no count, the frames that decode (a count from a duration or from the
    last packet's time is an estimate, never a reason to call a good file corrupt)."""
    if config.verify_images and header.estimated:
        return count_frames(path)
    return header.frames


def clip_frames(frames: int, fps: float, clip: tuple[float, float] | None,
                path: str) -> tuple[int, int]:
    """(first frame, frames) of a video's clip [start_s, end_s], as InternVL counts them."""
    if clip is None:
        return 0, frames
    first = clip_start(clip, fps)
    count = min(int((clip[1] - clip[0]) * fps), frames - first)
    if count <= 0:
        raise VideoError(f"video {path}: clip {list(clip)} holds no frame of its {frames} "
                         f"frames at {fps:g} frames/s")
    return first, count


def _error_message(errors: list[Skipped], specs: list[DatasetSpec]) -> str:
    files = {s.name: s.annotation for s in specs}
    lines = [_describe(e, files[e.dataset]) for e in errors[:10]]
    more = f"\n  ... and {len(errors) - 10} more in this chunk" if len(errors) > 10 else ""
    return ("sample(s) cannot be measured:\n  " + "\n  ".join(lines) + more
            + "\n(--on-error skip leaves such samples out and lists them in a skipped report)")


def _describe(e: Skipped, annotation: Path) -> str:
    ident = f" (id {e.id})" if e.id is not None else ""
    return f"{annotation}:{e.line}: sample {e.index}{ident}: {e.reason}"


def write_outputs(result: StatsResult, out: str | os.PathLike, fmt: str = "json",
                  skipped_path: str | os.PathLike | None = None) -> list[Path]:
    """Write the length file(s) and the skipped report; returns the paths written.

    `out` ending in `.npz`: one file holding every dataset (names kept), the stats
    configuration and the per-image tiles. `out` ending in `.json`: a meta JSON
    {"name": {"token_lengths": file, "stats_config": {...}}} with one
    `<name>_token_lengths.<fmt>` per dataset next to it (a plain OmniBal record list for
    `json`); load_lengths reads either back in dataset order.
    """
    out = Path(out)
    if out.suffix not in (".json", ".npz"):
        raise ValueError(f"{out}: the output must end in .npz (one file) or .json (a meta file "
                         "naming one length file per dataset, in --format)")
    if fmt not in ("json", "jsonl", "npz"):
        raise ValueError(f"format must be json, jsonl or npz, got {fmt!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_result(result)
    written = [out]
    if out.suffix == ".npz":
        tiles, videos, offset = {}, [], 0
        for stats, multi, table in zip(result.datasets, result.image_tiles, result.videos,
                                       strict=True):
            tiles.update({offset + i: t for i, t in multi.items()})
            videos.append(table.shifted(offset))
            offset += len(stats)
        ids = None if None in result.identities else [
            i for part in result.identities for i in part]
        save_lengths(result.stats, out, config=result.config, image_tiles=tiles,
                     videos=concat_videos(videos), identities=ids)
    else:
        meta = {}
        used: set[str] = set()
        for spec, stats, multi, table, ids in zip(result.specs, result.datasets,
                                                  result.image_tiles, result.videos,
                                                  result.identities, strict=True):
            stem = re.sub(r"[^A-Za-z0-9._-]", "_", spec.name) or "dataset"
            while stem in used:
                stem += "_"
            used.add(stem)
            child = out.parent / f"{stem}_token_lengths.{fmt}"
            save_lengths(stats, child, config=result.config, image_tiles=multi, videos=table,
                         identities=ids)
            written.append(child)
            meta[spec.name] = {"token_lengths": child.name, "stats_config": result.config}
        out.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    report = Path(skipped_path) if skipped_path else out.with_name(f"{out.stem}.skipped.json")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(skipped_report(result), indent=1, ensure_ascii=False) + "\n")
    written.append(report)
    return written


def _check_result(result: StatsResult) -> None:
    """The invariants of what is about to be written: every record measured or skipped once."""
    for spec, stats, n, multi in zip(result.specs, result.datasets, result.records,
                                     result.image_tiles, strict=True):
        repeat = spec.repeats
        skipped = sum(1 for s in result.skipped if s.dataset == spec.name)
        if len(stats) != (n - skipped) * repeat:
            raise RuntimeError(f"{spec.annotation}: {len(stats)} length entries for {n} "
                               f"records, {skipped} skipped, repeat {repeat}")
        if any(sum(t) != stats.image_flags[i] for i, t in multi.items()):
            raise RuntimeError(f"{spec.annotation}: per-image tiles do not add up")


def skipped_report(result: StatsResult) -> dict:
    """The skipped samples per dataset, with what a training loader needs to drop them too."""
    by_name: dict[str, list[dict]] = {s.name: [] for s in result.specs}
    for e in result.skipped:
        item = asdict(e)
        del item["dataset"]
        by_name[e.dataset].append(item)
    return {
        "note": "samples left out of the length file; drop the same annotation lines (by "
                "'index', 0-based, or 'line', 1-based) before repeat_time is applied",
        "datasets": {
            s.name: {"annotation": str(s.annotation), "records": n,
                     "repeat_time": s.repeat_time, "length_entries": len(d),
                     "skipped": by_name[s.name]}
            for s, d, n in zip(result.specs, result.datasets, result.records, strict=True)
        },
    }
