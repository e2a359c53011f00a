"""Training samples from a real LLaVA/InternVL dataset, exactly as `omnibal stats` measured them.

The balancer plans micro-batches from the length file (vit_num, token_num, image_flags per
sample); the samples it then draws must have exactly those lengths, or the balance (and the
planned memory) is fiction. So this source reuses what `omnibal stats` used: the annotation
reader, the record checks, the tiling, the chat template and the tokenizer (image tokens added the
same way). It renders each conversation, spells out tokens_per_tile image tokens per real tile,
sets the loss on assistant answers only, decodes and tiles the images, and compares every sample
it builds with its length record: a mismatch stops the run naming the sample and both counts.
`open_source` also checks the sample count and a spread of records before training starts.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from megatron_omnibal.data import conversations as conv
from megatron_omnibal.data.annotations import RawRecord, parse_record, read_inputs, read_records
from megatron_omnibal.data.image_header import ImageHeaderError, image_size
from megatron_omnibal.data.image_tiles import load_tiles
from megatron_omnibal.data.lengths import LengthStats
from megatron_omnibal.data.stats import StatsConfig
from megatron_omnibal.data.tiling import image_tiles
from megatron_omnibal.data.tokenization import TokenCounter

if TYPE_CHECKING:
    from megatron_omnibal.megatron.batch import Sample

IGNORE_INDEX = -100  # the same value as batch.IGNORE_INDEX (batch.py imports torch)
# Where each turn's text sits in the rendered template: (before, after) the turn's value. The
# loss covers an answer and what closes it (<|im_end|>\n, </s>), as InternVL and LLaVA train.
TURN_MARKS = {
    "internvl2_5": {"human": ("<|im_start|>user\n", "<|im_end|>\n"),
                    "gpt": ("<|im_start|>assistant\n", "<|im_end|>\n")},
    "vicuna_v1": {"human": ("USER: ", " "), "gpt": ("ASSISTANT: ", "</s>")},
}


class DatasetError(ValueError):
    """The dataset, its length file and the model disagree; the message names the sample."""


class RealSampleSource:
    """`source(index) -> Sample` for length record `index` of a real dataset."""

    def __init__(self, data: str | os.PathLike, config: StatsConfig, lengths: LengthStats,
                 tokens_per_tile: int, image_size: int, vocab_size: int, image_token_id: int,
                 image_root: str | os.PathLike | None = None,
                 skipped: str | os.PathLike | None = None) -> None:
        tiling = config.tiling
        if config.template not in TURN_MARKS:
            raise DatasetError(f"template {config.template!r}: training samples are built for "
                               f"the {' and '.join(TURN_MARKS)} templates only")
        if tiling.mode not in ("dynamic", "fixed"):
            raise DatasetError(f"tiling mode {tiling.mode!r}: the model takes tokens_per_tile "
                               "tokens per tile, which only dynamic and fixed tiling give")
        if tiling.tile != image_size or tiling.tokens_per_tile != tokens_per_tile:
            raise DatasetError(
                f"the length file's tiling ({tiling.tile}-pixel tiles, {tiling.tokens_per_tile} "
                f"tokens per tile) is not the model's ({image_size}-pixel tiles, "
                f"{tokens_per_tile} tokens per tile): run `omnibal stats` with --tile-size "
                f"{image_size} --tokens-per-tile {tokens_per_tile}")
        self.config = config
        self.lengths = lengths
        self.tokens_per_tile = tokens_per_tile
        self.vocab_size = vocab_size
        self.image_token_id = image_token_id
        self.counter = TokenCounter(config.tokenizer, config.image_style)
        if self.counter.backend is None:
            raise DatasetError(f"{config.tokenizer}: training samples need a fast tokenizer "
                               "(token offsets locate the answers)")
        self.context_id = self.counter.backend.token_to_id(config.image_style.context)
        self.specs, _ = read_inputs(data, image_root)
        self.tilings = [
            tiling if s.max_tiles is None else
            replace(tiling, max_tiles=s.max_tiles, min_tiles=min(tiling.min_tiles, s.max_tiles))
            for s in self.specs
        ]
        self.skipped = skipped
        self.entries = self._entries(_skipped_indices(skipped, self.specs))

    def _entries(self, skipped: dict[str, set[int]]) -> list[tuple[int, RawRecord]]:
        """(dataset, record) per length record, in the length file's order."""
        entries: list[tuple[int, RawRecord]] = []
        per_dataset = []
        for d, spec in enumerate(self.specs):
            records = [r for r in read_records(spec) if r.index not in skipped.get(spec.name, ())]
            repeat = int(spec.repeat_time) if spec.repeat_time > 1 else 1
            entries.extend([(d, r) for r in records] * repeat)
            per_dataset.append(len(records) * repeat)
        if len(entries) != len(self.lengths):
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

    def __len__(self) -> int:
        return len(self.entries)

    def describe(self, index: int) -> str:
        d, raw = self.entries[index]
        record_id = _record_id(raw)
        ident = f" (id {record_id})" if record_id is not None else ""
        return (f"{self.specs[d].annotation}:{raw.line}: sample {raw.index}{ident}, length "
                f"record {index}")

    def check(self, index: int, vit: int, tokens: int, flags: int) -> None:
        """Stop with both counts when a sample is not what its length record says."""
        want = (int(self.lengths.vit[index]), int(self.lengths.tokens[index]),
                int(self.lengths.image_flags[index]))
        if (vit, tokens, flags) != want:
            raise DatasetError(
                f"{self.describe(index)}: the length file says vit_num={want[0]}, "
                f"token_num={want[1]}, image_flags={want[2]}; the dataset gives vit_num={vit}, "
                f"token_num={tokens}, image_flags={flags} (the length file was made from other "
                "data, tokenizer or `omnibal stats` flags)")

    def render(self, index: int) -> tuple[np.ndarray, np.ndarray, list[str], list[int]]:
        """(token ids, loss flags per token, image paths, tiles per image) of a sample.

        Image placeholders are already expanded to the model's image token id.
        """
        if not 0 <= index < len(self.entries):
            raise IndexError(f"sample index {index} outside 0..{len(self.entries) - 1}")
        d, raw = self.entries[index]
        try:
            record = parse_record(raw)
            images = conv.sample_images(record)
            turns = conv.sample_turns(record)
            turns = conv.place_images(turns, len(images), isinstance(record.get("image"), str))
            paths = [os.path.join(self.specs[d].image_root, rel) for rel in images]
            tiles = [image_tiles(*image_size(p), self.tilings[d], len(images))[0] for p in paths]
        except (conv.SampleError, ImageHeaderError) as exc:
            raise DatasetError(f"{self.describe(index)}: {exc}") from exc
        if images:
            turns = conv.expand_images(turns, [self.config.image_style.compact()] * len(images))
        pieces = conv.render(turns, self.config.template, self.config.system)
        ids, target = self._tokenize(index, pieces, turns)
        return (*self._expand(index, ids, target, tiles), paths, tiles)

    def _tokenize(self, index: int, pieces: list[str],
                  turns: list[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        """Ids as `omnibal stats` counted them (pieces apart, specials once) and answer flags."""
        from tokenizers import Encoding

        backend = self.counter.backend
        spans = _answer_spans("".join(pieces), turns, self.config.template)
        if spans is None:
            raise DatasetError(f"{self.describe(index)}: cannot find the turns in the rendered "
                               f"{self.config.template} text")
        encodings = backend.encode_batch(pieces, add_special_tokens=False)
        flags, start = [], 0
        for piece, enc in zip(pieces, encodings, strict=True):
            flags.extend(any(a < start + e and start + s < b for a, b in spans)
                         for s, e in enc.offsets)
            start += len(piece)
        full = backend.post_process(Encoding.merge(encodings, growing_offsets=True))
        target = np.zeros(len(full.ids), bool)
        own = np.array([s is not None for s in full.sequence_ids], bool)
        target[own] = flags
        return np.asarray(full.ids, np.int64), target

    def _expand(self, index: int, ids: np.ndarray, target: np.ndarray,
                tiles: list[int]) -> tuple[np.ndarray, np.ndarray]:
        where = np.flatnonzero(ids == self.context_id)
        if len(where) != len(tiles) or target[where].any():
            raise DatasetError(f"{self.describe(index)}: {len(where)} image context tokens in "
                               f"the text for {len(tiles)} image(s)")
        bad = np.flatnonzero((ids >= self.vocab_size) | (ids < 0) | (ids == self.image_token_id))
        bad = bad[ids[bad] != self.context_id]
        if bad.size:
            raise DatasetError(
                f"{self.describe(index)}: token id {int(ids[bad[0]])} is the model's image "
                f"token id or outside its vocabulary of {self.vocab_size} (tokenizer "
                f"{self.config.tokenizer} does not fit the model)")
        counts = np.ones(len(ids), np.int64)
        counts[where] = np.asarray(tiles, np.int64) * self.tokens_per_tile
        ids = np.where(ids == self.context_id, self.image_token_id, ids)
        return np.repeat(ids, counts), np.repeat(target, counts)

    def measure(self, index: int) -> tuple[int, int, int]:
        """(vit_num, token_num, image_flags) of a sample, from image headers (no decoding)."""
        ids, _, paths, tiles = self.render(index)
        real = sum(tiles)
        return (real if paths else int(self.config.dummy_tile)), len(ids), real

    def __call__(self, index: int) -> Sample:
        import torch

        from megatron_omnibal.megatron.batch import Sample

        ids, target, paths, tiles = self.render(index)
        tiling = self.tilings[self.entries[index][0]]
        try:
            pixels = [load_tiles(p, tiling, len(paths)) for p in paths]
        except ValueError as exc:
            raise DatasetError(f"{self.describe(index)}: {exc}") from exc
        real = sum(len(p) for p in pixels)
        if real != sum(tiles):
            raise DatasetError(f"{self.describe(index)}: {real} tiles decoded, {sum(tiles)} "
                               "from the image headers")
        size = tiling.tile
        if not paths:
            pixels = [np.zeros((int(self.config.dummy_tile), 3, size, size), np.float32)]
        images = np.concatenate(pixels)
        self.check(index, len(images), len(ids), real)
        labels = np.full(len(ids), IGNORE_INDEX, np.int64)
        labels[:-1] = np.where(target[1:], ids[1:], IGNORE_INDEX)
        flags = np.zeros(len(images), np.int64)
        flags[:real] = 1
        return Sample(tokens=torch.from_numpy(ids), labels=torch.from_numpy(labels),
                      images=torch.from_numpy(images), image_flags=torch.from_numpy(flags))

    def check_spread(self, count: int) -> None:
        """Measure `count` records spread over the dataset (the first and last included)."""
        if count <= 0 or not len(self):
            return
        for index in np.unique(np.linspace(0, len(self) - 1, count).round().astype(np.int64)):
            self.check(int(index), *self.measure(int(index)))


def _answer_spans(text: str, turns: list[tuple[str, str]],
                  template: str) -> list[tuple[int, int]] | None:
    """Character spans of the answers (and their closing marks) in the rendered text."""
    marks = TURN_MARKS[template]
    spans, cursor = [], 0
    for role, value in turns:
        if role == "system":
            continue
        before, after = marks[role]
        needle = before + value + after
        pos = text.find(needle, cursor)
        if pos < 0:
            return None
        if role == "gpt":
            spans.append((pos + len(before), pos + len(needle)))
        cursor = pos + len(needle)
    return spans


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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise DatasetError(f"--omnibal-stats-args: {message}")


def stats_config(data: str, tokenizer: str, flags: str) -> tuple[StatsConfig, str | None]:
    """The StatsConfig and image root `omnibal stats <data> --tokenizer T <flags>` used."""
    from megatron_omnibal.commands import stats as command

    parser = _Parser(prog="omnibal stats", add_help=False)
    command.add_arguments(parser)
    ns = parser.parse_args([*shlex.split(flags), data, "--tokenizer", tokenizer,
                            "--out", "unused.json"])
    return command.build_config(ns), ns.image_root


def open_source(args: argparse.Namespace, lengths: LengthStats, spec: Any,
                check: int = 32) -> RealSampleSource:
    """The source of --omnibal-data PATH, checked against --omnibal-lengths (no process group).

    `check` records spread over the dataset are measured now; every sample again when built.
    """
    if args.omnibal_tokenizer is None:
        raise DatasetError(f"--omnibal-data {args.omnibal_data} needs --omnibal-tokenizer "
                           "(the tokenizer `omnibal stats` counted with)")
    if args.omnibal_text_scale != 1 or args.omnibal_data_tokens_per_tile != spec.tokens_per_tile:
        raise DatasetError(
            f"with a real dataset the length file is used as it is: --omnibal-text-scale 1 and "
            f"--omnibal-data-tokens-per-tile {spec.tokens_per_tile} (the model's), got "
            f"{args.omnibal_text_scale} and {args.omnibal_data_tokens_per_tile}")
    config, image_root = stats_config(args.omnibal_data, args.omnibal_tokenizer,
                                      args.omnibal_stats_args)
    report = Path(args.omnibal_lengths)
    try:
        source = RealSampleSource(
            args.omnibal_data, config, lengths, spec.tokens_per_tile, spec.vit.image_size,
            spec.llm.vocab_size, spec.image_token_id, image_root,
            skipped=report.with_name(f"{report.stem}.skipped.json"))
    except OSError as exc:  # a missing dataset, annotation or tokenizer
        raise DatasetError(f"--omnibal-data {args.omnibal_data}: {exc}") from exc
    source.check_spread(check)
    return source
