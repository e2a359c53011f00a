"""Length statistics of a real VLM dataset, computed the way the model will see it.

For every sample: `vit_num` (image tiles the vision encoder runs, a text-only sample's dummy tile
included), `image_flags` (the real tiles) and `token_num` (tokens of the whole conversation after
the chat template, image placeholders expanded to the image tokens). Images are measured from
their headers and tokens counted with the model's tokenizer, in worker processes.

A sample that cannot be measured (missing or corrupt image, bad conversation, more tokens than
`max_tokens`) stops the run (`on_error="error"`) or is left out of the length file and listed in
the skipped report (`on_error="skip"`): never dropped silently. The length file then holds the
remaining samples in dataset order, so the training loader must drop the listed samples too.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from megatron_omnibal.data import conversations as conv
from megatron_omnibal.data.annotations import (
    DatasetSpec,
    RawRecord,
    chunks,
    parse_record,
    read_inputs,
    read_records,
)
from megatron_omnibal.data.image_header import ImageHeaderError, image_size
from megatron_omnibal.data.lengths import LengthStats, concat, from_arrays, save_lengths
from megatron_omnibal.data.tiling import TilingConfig, image_tiles
from megatron_omnibal.data.tokenization import TokenCounter

ON_ERROR = ("error", "skip")


class StatsError(ValueError):
    """Samples that could not be measured, under on_error="error"; names file, line and id."""


@dataclass(frozen=True)
class StatsConfig:
    """What the model does with a sample: tokenizer, chat template, image tiling."""

    tokenizer: str
    tiling: TilingConfig = field(default_factory=TilingConfig)
    template: str = "internvl2_5"
    image_style: conv.ImageStyle = conv.INTERNVL_IMAGE
    system: str | None = None  # None: the template's default system message
    dummy_tile: bool = True  # a text-only sample still runs one blank tile through the ViT
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.template not in conv.TEMPLATES:
            raise ValueError(f"unknown template {self.template!r} "
                             f"(choose from {', '.join(conv.TEMPLATES)})")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")


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


_STATE: dict = {}


def compute_stats(path: str | os.PathLike, config: StatsConfig,
                  image_root: str | os.PathLike | None = None, on_error: str = "error",
                  workers: int = 1, chunk_size: int = 256,
                  progress: bool = True) -> StatsResult:
    """Length statistics of the dataset(s) at `path` (JSON list, JSONL or InternVL meta)."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    start = time.perf_counter()
    specs, is_meta = read_inputs(path, image_root)
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    if workers > 1:
        # Worker processes are the parallelism; the tokenizer's own thread pool would not
        # survive the fork (and would oversubscribe the cores). Restored when done.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return _compute(specs, is_meta, config, on_error, workers, chunk_size, progress, start)
    finally:
        _STATE.clear()
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _compute(specs: list[DatasetSpec], is_meta: bool, config: StatsConfig, on_error: str,
             workers: int, chunk_size: int, progress: bool, start: float) -> StatsResult:
    counter = TokenCounter(config.tokenizer, config.image_style)
    _STATE.update(config=config, counter=counter)
    if config.template == "hf":
        counter.render_chat([("human", "check"), ("gpt", "check")], config.system)
    records = [read_records(spec) for spec in specs]
    total = sum(len(r) for r in records)
    tasks = _tasks(specs, records, config, chunk_size)
    outs: list[_ChunkOut] = []
    skipped: list[Skipped] = []
    from tqdm import tqdm

    bar = tqdm(total=total, unit="sample", desc="omnibal stats", disable=not progress,
               file=sys.stderr, dynamic_ncols=True, smoothing=0.05, delay=1.0)
    pool = mp.get_context("fork").Pool(workers) if workers > 1 else None
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
    datasets = []
    for d, spec in enumerate(specs):
        mine = [o for o in outs if o.dataset == d]
        keep = np.concatenate([o.ok for o in mine]) if mine else np.zeros(0, bool)
        arrays = [np.concatenate([getattr(o, f) for o in mine])[keep] if mine
                  else np.zeros(0, np.int64) for f in ("vit", "tokens", "flags")]
        n_skipped = sum(len(o.errors) for o in mine)
        if int(keep.sum()) + n_skipped != len(records[d]):
            raise RuntimeError(f"{spec.annotation}: {int(keep.sum())} measured + {n_skipped} "
                               f"skipped != {len(records[d])} records")
        repeat = int(spec.repeat_time) if spec.repeat_time > 1 else 1
        vit, tokens, flags = (np.tile(a, repeat) for a in arrays)
        datasets.append(from_arrays(vit, tokens, flags, names=(spec.name,),
                                    source=str(spec.annotation)))
    return StatsResult(specs, datasets, skipped, [len(r) for r in records],
                       time.perf_counter() - start, is_meta, counter.added)


def _tasks(specs: list[DatasetSpec], records: list[list[RawRecord]], config: StatsConfig,
           chunk_size: int) -> Iterator[tuple]:
    for d, (spec, recs) in enumerate(zip(specs, records, strict=True)):
        tiling = config.tiling
        if spec.max_tiles is not None:
            tiling = replace(tiling, max_tiles=spec.max_tiles,
                             min_tiles=min(tiling.min_tiles, spec.max_tiles))
        for chunk in chunks(recs, chunk_size):
            yield d, spec.name, str(spec.image_root), tiling, chunk


def _run_chunk(task: tuple) -> _ChunkOut:
    """Measure one chunk of records (in a worker): images per sample, then one token batch."""
    dataset, name, root, tiling, chunk = task
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
    ids: list[str | None] = [None] * n
    for k, raw in enumerate(chunk):
        try:
            record = parse_record(raw)
            ids[k] = _sample_id(record)
            pieces, extra, vit[k], flags[k] = _measure(record, root, tiling, config, counter)
        except (conv.SampleError, ImageHeaderError) as exc:
            ok[k] = False
            errors.append(Skipped(name, raw.index, raw.line, ids[k], str(exc)))
            continue
        tokens[k] = extra
        texts.extend(pieces)
        owner.extend([k] * len(pieces))
    if texts:
        np.add.at(tokens, np.asarray(owner), np.asarray(counter.count(texts), np.int64))
    if config.max_tokens is not None:
        for k in np.flatnonzero(ok & (tokens > config.max_tokens)):
            ok[k] = False
            raw = chunk[k]
            errors.append(Skipped(name, raw.index, raw.line, ids[k],
                                  f"over-long: {int(tokens[k])} tokens > --max-tokens "
                                  f"{config.max_tokens}"))
    errors.sort(key=lambda e: e.index)
    return _ChunkOut(dataset, vit, tokens, flags, ok, errors)


def _sample_id(record: dict) -> str | None:
    value = record.get("id")
    return None if value is None else str(value)


def _measure(record: dict, root: str, tiling: TilingConfig, config: StatsConfig,
             counter: TokenCounter) -> tuple[list[str], int, int, int]:
    """(text pieces, image tokens beyond one per image, vit_num, image_flags) of a sample."""
    images = conv.sample_images(record)
    turns = conv.sample_turns(record)
    turns = conv.place_images(turns, len(images), isinstance(record.get("image"), str))
    style = config.image_style
    tiles = 0
    extra = 0
    for rel in images:
        width, height = image_size(os.path.join(root, rel))
        n_tiles, n_tokens = image_tiles(width, height, tiling, len(images))
        tiles += n_tiles
        extra += n_tokens - 1
    if images:
        turns = conv.expand_images(turns, [style.compact()] * len(images))
    if config.template == "hf":
        pieces = [counter.render_chat(turns, config.system)]
    else:
        pieces = conv.render(turns, config.template, config.system)
        extra += counter.specials
    vit = tiles if images else int(config.dummy_tile)
    return pieces, extra, vit, tiles


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

    A single dataset goes to `out` (.json list, .jsonl or .npz, by suffix). A meta input gives
    one `<name>_token_lengths.<fmt>` per dataset next to `out`, and `out` itself is the meta JSON
    {"name": {"token_lengths": file}} that load_lengths reads back in the same order.
    """
    out = Path(out)
    if out.suffix not in (".json", ".jsonl", ".npz"):
        raise ValueError(f"{out}: the output must end in .json, .jsonl or .npz")
    if fmt not in ("json", "jsonl", "npz"):
        raise ValueError(f"format must be json, jsonl or npz, got {fmt!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    written = []
    if result.is_meta:
        if out.suffix != ".json":
            raise ValueError(f"{out}: for a meta input the output is a meta .json file")
        meta = {}
        used: set[str] = set()
        for spec, stats in zip(result.specs, result.datasets, strict=True):
            stem = re.sub(r"[^A-Za-z0-9._-]", "_", spec.name) or "dataset"
            while stem in used:
                stem += "_"
            used.add(stem)
            child = out.parent / f"{stem}_token_lengths.{fmt}"
            save_lengths(stats, child)
            written.append(child)
            meta[spec.name] = {"token_lengths": child.name}
        out.write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    else:
        save_lengths(result.datasets[0], out)
    written.insert(0, out)
    report = Path(skipped_path) if skipped_path else out.with_name(f"{out.stem}.skipped.json")
    report.write_text(json.dumps(skipped_report(result), indent=1, ensure_ascii=False) + "\n")
    written.append(report)
    return written


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
