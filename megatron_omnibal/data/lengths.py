"""Per-sample length statistics: reading, validating, caching and writing them.

Balancing needs two numbers per sample: image tiles the vision encoder sees (`vit_num`) and tokens
the LLM sees (`token_num`), plus `image_flags`, the real (non-dummy) tiles. They arrive as the
OmniBal JSON list, as a meta JSON naming one such file per dataset, as JSONL, or as our compact
`.npz`. Every record is checked, and an error names the file and the record index, because a
silently wrong length becomes a silently unbalanced (or crashing) training job days later.

`omnibal stats` also stores how it counted (data/sample/config.py) in a `.npz` (`stats_config`)
or in each entry of a meta JSON, the tiles of each image of a multi-image sample
(`image_tiles`), which the training loader needs on ranks that never open the images, and the
video table (`video_*` arrays of a `.npz`, `video_frames`/`video_fps`/`video_tiles` lists of a
JSON record), from which each epoch's frame counts follow (data/video_lengths.py). Files
without them (older ones, image-only data) load as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

FORMAT_VERSION = 1
FIELDS = ("vit_num", "token_num", "image_flags")


class LengthsError(ValueError):
    """Bad length statistics: the message names the file and, where known, the record index."""


@dataclass(frozen=True)
class LengthStats:
    """Length statistics of a dataset, one entry per sample, in sample-index order.

    `dataset[i]` indexes `names`: the dataset (meta-file entry) sample i came from.
    """

    vit: np.ndarray
    tokens: np.ndarray
    image_flags: np.ndarray
    dataset: np.ndarray
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        n = len(self.vit)
        for field in ("tokens", "image_flags", "dataset"):
            if len(getattr(self, field)) != n:
                raise LengthsError(f"length statistics: '{field}' has {len(getattr(self, field))} "
                                   f"entries, 'vit' has {n}")

    def __len__(self) -> int:
        return len(self.vit)

    def subset(self, index: np.ndarray) -> LengthStats:
        """The statistics of the samples `index`, in that order."""
        return LengthStats(self.vit[index], self.tokens[index], self.image_flags[index],
                           self.dataset[index], self.names)

    def repeat(self, times: int) -> LengthStats:
        """The data concatenated `times` times (for timing at scale, never for quality)."""
        return LengthStats(np.tile(self.vit, times), np.tile(self.tokens, times),
                           np.tile(self.image_flags, times), np.tile(self.dataset, times),
                           self.names)


def from_arrays(vit: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray,
                image_flags: Sequence[int] | np.ndarray | None = None,
                dataset: Sequence[int] | np.ndarray | None = None,
                names: Sequence[str] = ("data",), source: str = "<arrays>") -> LengthStats:
    """Build validated statistics from arrays (image_flags default to vit, dataset to 0)."""
    vit_a = np.asarray(vit, dtype=np.int64)
    tok_a = np.asarray(tokens, dtype=np.int64)
    flags_a = vit_a.copy() if image_flags is None else np.asarray(image_flags, dtype=np.int64)
    ds_a = np.zeros(len(vit_a), np.int32) if dataset is None else np.asarray(dataset, np.int32)
    stats = LengthStats(vit_a, tok_a, flags_a, ds_a, tuple(names))
    _check_values(stats, source)
    return stats


def concat(parts: Iterable[LengthStats]) -> LengthStats:
    """Concatenate statistics, keeping each part's dataset names distinct."""
    parts = list(parts)
    names: list[str] = []
    datasets = []
    for part in parts:
        datasets.append(part.dataset + len(names))
        names.extend(part.names)
    return LengthStats(
        np.concatenate([p.vit for p in parts]).astype(np.int64),
        np.concatenate([p.tokens for p in parts]).astype(np.int64),
        np.concatenate([p.image_flags for p in parts]).astype(np.int64),
        np.concatenate(datasets).astype(np.int32),
        tuple(names),
    )


def load_lengths(path: str | os.PathLike, cache: bool = True) -> LengthStats:
    """Read length statistics from `.npz`, a JSON list, a meta JSON or JSONL.

    With `cache`, parsed JSON is kept as `.npz` under $OMNIBAL_CACHE_DIR (default
    ~/.cache/omnibal), keyed by the file's path, size and mtime, so a 1.2M-record file parses
    once; the cache is never written next to the input (it may be read-only).
    """
    path = Path(path)
    if not path.is_file():
        raise LengthsError(f"{path}: no such length-statistics file")
    if path.suffix == ".npz":
        return _load_npz(path)
    cache_file = _cache_path(path) if cache else None
    if cache_file is not None and cache_file.is_file():
        try:
            return _load_npz(cache_file)
        except LengthsError:
            cache_file.unlink(missing_ok=True)
    stats = _load_text(path)
    if cache_file is not None:
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".{os.getpid()}.tmp.npz")
            save_lengths(stats, tmp)
            tmp.replace(cache_file)
        except OSError:
            pass  # a cache that cannot be written only costs the next parse
    return stats


ImageTiles = dict[int, tuple[int, ...]]  # sample index -> tiles of each image (2+ images)
VIDEO_FIELDS = ("frames", "fps", "tiles")


@dataclass(frozen=True)
class VideoTable:
    """Every video of a length file, in sample order (a sample may hold several)."""

    sample: np.ndarray  # int64 [V]: the length record the video belongs to (ascending)
    frames: np.ndarray  # int64 [V]: frames available (header; estimated when not stored)
    fps: np.ndarray  # float64 [V]: frame rate
    tiles: np.ndarray  # int64 [V]: frames (= tiles) the length record counts

    def __len__(self) -> int:
        return len(self.sample)

    @classmethod
    def empty(cls) -> VideoTable:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float64),
                   np.zeros(0, np.int64))

    def of_sample(self, index: int) -> np.ndarray:
        """Positions in the table of the videos of length record `index`."""
        lo, hi = np.searchsorted(self.sample, [index, index + 1])
        return np.arange(lo, hi)

    def check(self, lengths: LengthStats, where: str) -> None:
        """The table fits the length records: samples in range and in order, counts that add
        up to no more than the record's real tiles."""
        if not len(self):
            return
        if (np.any(np.diff(self.sample) < 0) or self.sample[0] < 0
                or self.sample[-1] >= len(lengths)):
            raise LengthsError(f"{where}: video table samples out of order or out of range")
        if np.any(self.frames <= 0) or np.any(self.fps <= 0) or np.any(self.tiles <= 0):
            raise LengthsError(f"{where}: video table with a frame count or rate <= 0")
        per_sample = np.bincount(self.sample, self.tiles, len(lengths)).astype(np.int64)
        over = np.flatnonzero(per_sample > lengths.image_flags)
        if over.size:
            i = int(over[0])
            raise LengthsError(f"{where}: record {i}: its videos count {per_sample[i]} frames, "
                               f"more than its image_flags {int(lengths.image_flags[i])}")

    def shifted(self, offset: int) -> VideoTable:
        return VideoTable(self.sample + offset, self.frames, self.fps, self.tiles)


def concat_videos(parts: Iterable[VideoTable]) -> VideoTable:
    """Tables of consecutive length files (each already shifted to its first sample)."""
    parts = [p for p in parts if len(p)] or [VideoTable.empty()]
    return VideoTable(*(np.concatenate([getattr(p, f) for p in parts])
                        for f in ("sample", *VIDEO_FIELDS)))


def save_lengths(stats: LengthStats, path: str | os.PathLike, config: dict | None = None,
                 image_tiles: ImageTiles | None = None, videos: VideoTable | None = None,
                 identities: Sequence[tuple[str, str]] | None = None) -> None:
    """Write statistics as `.npz` (compact), `.jsonl` or a `.json` list, chosen by suffix.

    `config` (the stats configuration) is stored in a `.npz` only; a JSON list keeps the
    OmniBal record format (a meta JSON entry carries the configuration instead).
    `identities`: (shard, key) of each sample of an Energon dataset (`shard`/`key` fields of a
    JSON record).
    """
    path = Path(path)
    if identities is not None and len(identities) != len(stats):
        raise LengthsError(f"{path}: {len(identities)} sample identities for {len(stats)} "
                           "samples")
    tiles = image_tiles or {}
    bad = [i for i, t in tiles.items() if not 0 <= i < len(stats) or sum(t)
           != stats.image_flags[i]]
    if bad:
        raise LengthsError(f"{path}: image_tiles of sample {bad[0]} do not add up to its "
                           "image_flags")
    videos = videos if videos is not None else VideoTable.empty()
    videos.check(stats, str(path))
    if path.suffix == ".npz":
        order = sorted(tiles)
        ptr = np.cumsum([0, *(len(tiles[i]) for i in order)])
        extra = {"stats_config": np.array(json.dumps(config))} if config is not None else {}
        if identities is not None:
            shards = sorted({shard for shard, _ in identities})
            where = {shard: k for k, shard in enumerate(shards)}
            extra.update(shard_names=np.array(json.dumps(shards)),
                         sample_shard=np.asarray([where[s] for s, _ in identities], np.int32),
                         sample_key=np.asarray([key for _, key in identities], np.str_))
        np.savez_compressed(
            path,
            vit=stats.vit.astype(_smallest_uint(stats.vit)),
            tokens=stats.tokens.astype(_smallest_uint(stats.tokens)),
            image_flags=stats.image_flags.astype(_smallest_uint(stats.image_flags)),
            dataset=stats.dataset.astype(_smallest_uint(stats.dataset)),
            names=np.array(json.dumps(list(stats.names))),
            version=np.array(FORMAT_VERSION),
            multi_index=np.asarray(order, np.int64),
            multi_ptr=ptr.astype(np.int64),
            multi_tiles=np.asarray([t for i in order for t in tiles[i]], np.int64),
            video_sample=videos.sample, video_frames=videos.frames, video_fps=videos.fps,
            video_tiles=videos.tiles,
            **extra,
        )
        return
    records = [{"vit_num": int(v), "token_num": int(t), "image_flags": int(f)}
               for v, t, f in zip(stats.vit, stats.tokens, stats.image_flags, strict=True)]
    for i, t in tiles.items():
        records[i]["image_tiles"] = [int(x) for x in t]
    for record, (shard, key) in zip(records, identities or (), strict=False):
        record.update(shard=shard, key=key)
    for field in VIDEO_FIELDS:
        for i, value in zip(videos.sample, getattr(videos, field), strict=True):
            records[int(i)].setdefault(f"video_{field}", []).append(value.item())
    with open(path, "w") as fh:
        if path.suffix == ".jsonl":
            fh.writelines(json.dumps(r) + "\n" for r in records)
        else:
            json.dump(records, fh)


def read_stats_config(path: str | os.PathLike) -> dict | None:
    """The stats configuration stored in a length file (None: none stored, e.g. a plain
    OmniBal JSON list). A meta JSON's entries must all carry the same one, or none."""
    path = Path(path)
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            return json.loads(str(z["stats_config"])) if "stats_config" in z.files else None
    meta = _meta_doc(path)
    if meta is None:
        return None
    configs = [entry.get("stats_config") for entry in meta.values()]
    if any(c != configs[0] for c in configs):
        raise LengthsError(f"{path}: the datasets carry different stats configurations "
                           "(made by separate `omnibal stats` runs); measure them in one run")
    return configs[0]


def load_image_tiles(path: str | os.PathLike) -> ImageTiles:
    """Tiles of each image of the multi-image samples, by sample index (meta order)."""
    return {offset + i: t for offset, tiles in _per_dataset(Path(path), _image_tiles)
            for i, t in tiles.items()}


def tiles_per_image(stats: LengthStats, multi: ImageTiles) -> np.ndarray:
    """int64 tiles of every image, sample after sample: a multi-image sample's own per-image
    tiles, any other sample's real tiles as one image (none for text-only samples). A
    native-resolution model's attention cost depends on each image's size, not the sample's."""
    single = stats.image_flags.astype(np.int64).copy()
    single[list(multi)] = 0
    out = [single[single > 0]] + [np.asarray(t, np.int64) for t in multi.values()]
    return np.concatenate(out)


def load_identities(path: str | os.PathLike) -> list[tuple[str, str]] | None:
    """(shard, key) of each sample (meta order) of a length file made from Energon datasets;
    None when it stores none."""
    parts = [ids for _, ids in _per_dataset(Path(path), _identities)]
    return None if any(p is None for p in parts) else [i for p in parts for i in p]


def _identities(path: Path) -> list[tuple[str, str]] | None:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            if "sample_key" not in z.files:
                return None
            shards = json.loads(str(z["shard_names"]))
            return [(shards[s], str(k)) for s, k in zip(z["sample_shard"], z["sample_key"],
                                                         strict=True)]
    records = _text_records(path)
    if not records or not all(isinstance(r, dict) and "key" in r for r in records):
        return None
    return [(str(r["shard"]), str(r["key"])) for r in records]


def load_videos(path: str | os.PathLike) -> VideoTable:
    """The video table of a length file (meta order; empty for image-only or older files)."""
    return concat_videos([table.shifted(offset)
                          for offset, table in _per_dataset(Path(path), _videos)])


_Part = TypeVar("_Part")


def _per_dataset(path: Path, read: Callable[[Path], _Part]) -> list[tuple[int, _Part]]:
    """`read` of each dataset's length file with the index of its first sample (meta order);
    a file that is not a meta file is its one dataset."""
    meta = _meta_doc(path)
    if meta is None:
        return [(0, read(path))]
    parts, offset = [], 0
    for entry in meta.values():
        child = (path.parent / str(entry["token_lengths"])).resolve()
        parts.append((offset, read(child)))
        offset += len(load_lengths(child))
    return parts


def _videos(path: Path) -> VideoTable:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            if "video_sample" not in z.files:
                return VideoTable.empty()
            return VideoTable(z["video_sample"].astype(np.int64),
                              z["video_frames"].astype(np.int64),
                              z["video_fps"].astype(np.float64),
                              z["video_tiles"].astype(np.int64))
    found: dict[str, list] = {"sample": [], **{f: [] for f in VIDEO_FIELDS}}
    for i, r in enumerate(_text_records(path)):
        if isinstance(r, dict) and "video_frames" in r:
            found["sample"].extend([i] * len(r["video_frames"]))
            for field in VIDEO_FIELDS:
                found[field].extend(r[f"video_{field}"])
    return VideoTable(np.asarray(found["sample"], np.int64),
                      np.asarray(found["frames"], np.int64),
                      np.asarray(found["fps"], np.float64), np.asarray(found["tiles"], np.int64))


def _text_records(path: Path) -> list:
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def _image_tiles(path: Path) -> ImageTiles:
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            if "multi_index" not in z.files:
                return {}
            index, ptr, tiles = z["multi_index"], z["multi_ptr"], z["multi_tiles"]
        return {int(i): tuple(int(t) for t in tiles[ptr[k]:ptr[k + 1]])
                for k, i in enumerate(index)}
    return {i: tuple(r["image_tiles"]) for i, r in enumerate(_text_records(path))
            if isinstance(r, dict) and "image_tiles" in r}


def _meta_doc(path: Path) -> dict | None:
    """The meta JSON object of a length file, or None if it is not one."""
    if path.suffix == ".npz":
        return None
    try:
        with open(path) as fh:
            if fh.read(4096).lstrip()[:1] != "{":
                return None
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or _is_record(doc) or not all(
            isinstance(e, dict) and "token_lengths" in e for e in doc.values()):
        return None
    return doc


def _load_npz(path: Path) -> LengthStats:
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["version"]) != FORMAT_VERSION:
                raise LengthsError(f"{path}: length cache format {int(z['version'])}, "
                                   f"expected {FORMAT_VERSION}")
            stats = LengthStats(z["vit"].astype(np.int64), z["tokens"].astype(np.int64),
                                z["image_flags"].astype(np.int64), z["dataset"].astype(np.int32),
                                tuple(json.loads(str(z["names"]))))
    except (OSError, KeyError, ValueError) as exc:
        if isinstance(exc, LengthsError):
            raise
        raise LengthsError(f"{path}: not a length-statistics .npz ({exc})") from exc
    _check_values(stats, str(path))
    return stats


def _load_text(path: Path) -> LengthStats:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise LengthsError(f"{path}: cannot read ({exc})") from exc
    stripped = text.lstrip()
    if stripped.startswith("["):
        return _parse_list(_json_loads(text, path), path)
    if stripped.startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError:
            return _parse_jsonl(text, path)  # several objects, one per line
        if isinstance(doc, dict) and _is_record(doc):
            return _parse_jsonl(text, path)  # a JSONL file holding one record
        return _parse_meta(doc, path)
    raise LengthsError(f"{path}: expected a JSON list of records, a meta JSON object or JSONL")


def _json_loads(text: str, path: Path) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LengthsError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: "
                           f"{exc.msg}") from exc


def _is_record(doc: dict) -> bool:
    return "vit_num" in doc or "token_num" in doc


def _parse_jsonl(text: str, path: Path) -> LengthStats:
    records = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise LengthsError(f"{path}: line {lineno} (record {len(records)}): invalid JSON: "
                               f"{exc.msg}") from exc
    return _parse_list(records, path)


def _parse_meta(doc: object, path: Path) -> LengthStats:
    if not isinstance(doc, dict) or not doc:
        raise LengthsError(f"{path}: a meta file must map dataset names to "
                           "{'token_lengths': path}")
    parts = []
    for name, entry in doc.items():
        if not isinstance(entry, dict) or "token_lengths" not in entry:
            raise LengthsError(f"{path}: dataset '{name}' has no 'token_lengths' entry")
        child = (path.parent / str(entry["token_lengths"])).resolve()
        if not child.is_file():
            raise LengthsError(f"{path}: dataset '{name}': token_lengths file {child} not found")
        part = _load_npz(child) if child.suffix == ".npz" else _load_text(child)
        parts.append(LengthStats(part.vit, part.tokens, part.image_flags,
                                 np.zeros(len(part), np.int32), (str(name),)))
    return concat(parts)


def _parse_list(records: object, path: Path) -> LengthStats:
    if not isinstance(records, list):
        raise LengthsError(f"{path}: expected a list of records")
    n = len(records)
    vit = np.empty(n, np.int64)
    tokens = np.empty(n, np.int64)
    flags = np.empty(n, np.int64)
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise LengthsError(f"{path}: record {i}: expected an object, got {type(rec).__name__}")
        flag_key = "image_flags" if "image_flags" in rec else "image_flag"
        vit[i] = _integer(rec, "vit_num", path, i)
        tokens[i] = _integer(rec, "token_num", path, i)
        flags[i] = _integer(rec, flag_key, path, i)
    stats = LengthStats(vit, tokens, flags, np.zeros(n, np.int32), (path.stem,))
    _check_values(stats, str(path))
    return stats


def _integer(rec: dict, key: str, path: Path, index: int) -> int:
    if key not in rec:
        wanted = "image_flags' or 'image_flag" if key == "image_flag" else key
        raise LengthsError(f"{path}: record {index}: missing field '{wanted}'")
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LengthsError(f"{path}: record {index}: '{key}' must be an integer, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise LengthsError(f"{path}: record {index}: '{key}' must be an integer, got {value!r}")
    return int(value)


def _check_values(stats: LengthStats, source: str) -> None:
    """Vectorised range checks; the first offending record is named."""
    checks = (
        (stats.vit < 0, "'vit_num' is negative"),
        (stats.tokens <= 0, "'token_num' must be positive"),
        (stats.image_flags < 0, "'image_flags' is negative"),
        (stats.image_flags > stats.vit, "'image_flags' exceeds 'vit_num' (real tiles > tiles)"),
    )
    for bad, what in checks:
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise LengthsError(f"{source}: record {i}: {what} (vit_num={int(stats.vit[i])}, "
                               f"token_num={int(stats.tokens[i])}, "
                               f"image_flags={int(stats.image_flags[i])}); "
                               f"{int(bad.sum())} such record(s)")
    if len(stats.names) == 0 or (len(stats) and int(stats.dataset.max()) >= len(stats.names)):
        raise LengthsError(f"{source}: dataset index out of range of {len(stats.names)} names")


def _smallest_uint(values: np.ndarray) -> type:
    top = int(values.max()) if len(values) else 0
    for dtype in (np.uint8, np.uint16, np.uint32):
        if top <= np.iinfo(dtype).max:
            return dtype
    return np.int64


def _cache_path(path: Path) -> Path | None:
    try:
        st = path.stat()
    except OSError:
        return None
    root = Path(os.environ.get("OMNIBAL_CACHE_DIR", Path.home() / ".cache" / "omnibal"))
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{FORMAT_VERSION}"
    return root / f"lengths-{hashlib.sha1(key.encode()).hexdigest()[:16]}.npz"
