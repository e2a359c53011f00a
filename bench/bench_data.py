"""Throughput of the training data loader on a generated dataset of real image and video files.

The bench writes, in a temp dir: `--images` JPEG/PNG files (smooth colour fields with noise, 200
to 1600 pixels a side), `--samples` records over them in two layouts (InternVL meta + JSONL with
`<img>...</img>` images, dynamic 448-pixel tiles; LLaVA JSON list, one padded 336-pixel tile),
a third layout mixing those image records with video records (InternVL, 8-32 frames of one
448-pixel tile each, 'rand' sampling) over short videos of several codecs and containers
(H.264 in MP4 and MKV, VP8 in WebM, MPEG-4 part 2 in MP4, Motion JPEG in AVI; 1-60 s,
240p-1080p, a keyframe every 2 s except the all-intra MJPEG), and a BPE tokenizer trained on
the fly; `omnibal stats` measures all three. Then, side by side in
one run, it draws balanced micro-batches through the real loader (BalancedDataIterator over
RealSampleSource) as a first-stage rank does (decode, resize, tile, normalize) with 0, 1 and 2
DataLoader workers, and as a later-stage rank does (tokens and labels, no image opened).

Figures per case: micro-batches/s delivered to the training process (after a warm-up
micro-batch per worker, so worker start-up is not counted; first-stage cases the best of
`--repeats` interleaved runs of 60 micro-batches, as single runs varied by 10-20% on this
machine), and CPU seconds per sample spent on the training process's own thread
(time.thread_time: what a training step would lose).
The video layout also reports frames decoded per frame trained (in the no-worker run; the
decoder decodes exactly the frames an exact decoder must, data/video/exact_decode.py: for each
planned frame, those from the later of its keyframe and the previous planned frame, B-frames
not planned left out; bench/bench_video.py checks that against the bound and torchcodec).
Targets on a 2-core machine: 2 workers >= 1.6x no worker; a later-stage rank >= 10x the first
stage's (both without workers).

An Energon section then compares, on a prepared Energon dataset of `--energon-samples` records
over pictures of 300-800 pixels, the balanced path's samples/s (planned samples fetched by key) with
Energon's own get_train_dataset + get_loader decoding through the same code; goal >= 0.9x.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_data.py --json bench_data.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

WORDS = ["the", "of", "and", "to", "in", "is", "chart", "table", "value", "year", "total",
         "figure", "shows", "what", "how", "many", "image", "picture", "left", "right", "red",
         "blue", "green", "number", "text", "page", "answer", "question", "percent"]
LAYOUTS = {  # model preset, stats flags, budgets (tiles, tokens) per micro-batch
    "internvl": ("internvl2-8b", ["--max-tiles", "6"], 40, 12_000),
    "llava": ("llava-1.5-7b", [], 8, 6_000),
    "video": ("internvl2-8b", ["--max-tiles", "6"], 40, 12_000),
}
DATA = {"internvl": "meta.json", "llava": "llava.json", "video": "video.json"}
# (file, codec, seconds, width x height, frames/s): the bench's videos
VIDEOS = [("v0.mp4", "libx264", 1, (426, 240), 30), ("v1.webm", "libvpx", 5, (640, 360), 25),
          ("v2.mkv", "libx264", 12, (854, 480), 30), ("v3.mp4", "mpeg4", 20, (1280, 720), 25),
          ("v4.avi", "mjpeg", 8, (640, 480), 15), ("v5.mkv", "libx264", 60, (1920, 1080), 24)]


def gradient_frames(size: tuple[int, int]) -> Callable[[int], np.ndarray]:
    """Frame k of a moving colour gradient of `size` (width, height): cheap to encode, and
    every frame differs from the one before."""
    w, h = size
    ramp = (np.arange(w)[None, :] + np.arange(h)[:, None]).astype(np.int64)

    def picture(k: int) -> np.ndarray:
        img = np.empty((h, w, 3), np.uint8)
        img[..., 0] = (ramp + 4 * k) % 256
        img[..., 1] = (ramp // 2 + k) % 256
        img[..., 2] = (k * 7) % 256
        return img

    return picture


def write_bench_video(path: Path, codec: str, seconds: int, size: tuple[int, int],
                      fps: int) -> None:
    """A moving colour gradient, fast to encode (x264 superfast, which still writes B-frames as
    most real H.264 files have; VP8 realtime)."""
    from megatron_omnibal.data.formats.generate import write_video

    picture = gradient_frames(size)
    options = {"preset": "superfast"} if codec == "libx264" else (
        {"deadline": "realtime", "cpu-used": "8"} if codec == "libvpx" else {})
    gop = 1 if codec == "mjpeg" else 2 * fps
    write_video(path, codec, seconds * fps, fps, size, gop, picture, options)


def generate(root: Path, samples: int, images: int, seed: int, videos: bool = True) -> None:
    """Images, the InternVL meta + JSONL, the LLaVA JSON list and a tokenizer under root (and
    the videos of the video layout)."""
    from megatron_omnibal.data.formats.generate import (
        image_array,
        save_image,
        train_tokenizer,
        write_json_list,
        write_jsonl,
        write_meta,
    )

    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    files = []
    for k in range(images):
        w, h = rng.randint(200, 1600), rng.randint(200, 1600)
        name = f"{k:04d}.{'png' if k % 5 == 0 else 'jpg'}"
        save_image(root / "images" / name,
                   image_array(w, h, (0, 0, k % 256), noise=40, gradient=True, rng=nrng))
        files.append(name)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    recs = []
    for i in range(samples):
        conv = [{"from": "human", "value": "<image>\n" + words(5, 30)},
                {"from": "gpt", "value": words(10, 120)}]
        recs.append({"id": f"s{i}", "image": rng.choice(files), "conversations": conv})
    write_json_list(root / "llava.json", recs)
    write_jsonl(root / "part.jsonl", recs)
    write_meta(root / "meta.json", {"part": {"root": "images", "annotation": "part.jsonl"}})
    for name, codec, seconds, size, fps in VIDEOS if videos else ():
        write_bench_video(root / "images" / name, codec, seconds, size, fps)
    mixed = [dict(r) for r in recs]
    for i in range(0, len(mixed), 3):  # every third record a video one
        mixed[i] = {"id": f"v{i}", "video": rng.choice(VIDEOS)[0], "conversations": [
            {"from": "human", "value": "<video>\n" + words(5, 30)},
            {"from": "gpt", "value": words(10, 120)}]}
    write_jsonl(root / "mixed.jsonl", mixed)
    write_meta(root / "video.json", {"mixed": {"root": "images", "annotation": "mixed.jsonl"}})
    tok = train_tokenizer([words(20, 60) for _ in range(300)], vocab_size=300)
    tok.save(str(root / "tokenizer.json"))


def measure(root: Path, layout: str, pixels: bool, workers: int, micro: int) -> dict:
    """Draw `micro` balanced micro-batches as one rank does; time the training thread."""
    from megatron_omnibal.balance.config import BalanceConfig
    from megatron_omnibal.balance.sampler import BalancedBatchSampler
    from megatron_omnibal.data.lengths import load_lengths
    from megatron_omnibal.data.video_lengths import run_lengths
    from megatron_omnibal.megatron.stream.data import BalancedDataIterator
    from megatron_omnibal.megatron.stream.dataset import open_source
    from megatron_omnibal.megatron.stream.iterators import filler_sample
    from megatron_omnibal.megatron.stream.loader import MicroBatchDataset
    from megatron_omnibal.megatron.stream.source import SourceSettings
    from megatron_omnibal.models.presets import get_preset

    preset, _, vit_budget, token_budget = LAYOUTS[layout]
    spec = get_preset(preset)
    data = root / DATA[layout]
    lengths_path = root / f"{layout}_lengths.npz"
    lengths = load_lengths(lengths_path)
    args = SourceSettings(data=str(data), lengths_path=str(lengths_path))
    by_epoch = run_lengths(lengths_path, lengths, seed=0)
    source = open_source(args, lengths, spec, pixels=pixels, check=0, by_epoch=by_epoch)
    config = BalanceConfig(dp_size=1, micro_batches=1, vit_budget=vit_budget,
                           token_budget=token_budget, seed=0)
    sampler = BalancedBatchSampler(lengths, config, dp_rank=0, lengths_of_epoch=by_epoch)
    it = BalancedDataIterator(sampler, 1, MicroBatchDataset(source, lambda: filler_sample(spec)),
                              num_workers=workers)
    for _ in range(max(1, workers)):  # warm-up: worker start-up and first batches
        next(it)
    samples = 0
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(micro):
        batch = next(it)
        samples += batch.num_samples
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    del it
    out = {"layout": layout, "rank": "first stage" if pixels else "later stage",
           "workers": workers, "micro_batches": micro, "samples": samples,
           "micro_per_s": micro / wall, "main_thread_cpu_s_per_sample": cpu / samples}
    if source.frames_trained:  # decoded in this process (no workers)
        out["decoded_per_trained_frame"] = source.frames_decoded / source.frames_trained
    return out


def generate_energon(root: Path, samples: int, images: int, seed: int) -> Path:
    """`samples` single-image records over `images` JPEG/PNG pictures of 300-800 pixels a side
    (alike in decoding cost, so that the samples each loader times cost the same on average),
    as a LLaVA JSON list and as a prepared Energon dataset (omnibal export-energon: crude
    samples, the image bytes as they are), measured by `omnibal stats` on the Energon form."""
    from megatron_omnibal.cli import main as cli_main
    from megatron_omnibal.data.energon.export import export_energon
    from megatron_omnibal.data.formats.generate import image_array, save_image, write_json_list

    rng = random.Random(seed + 1)
    nrng = np.random.default_rng(seed + 1)
    (root / "energon_images").mkdir()
    files = []
    for k in range(images):
        name = f"{k:04d}.{'png' if k % 5 == 0 else 'jpg'}"
        save_image(root / "energon_images" / name,
                   image_array(rng.randint(300, 800), rng.randint(300, 800), (k % 256, 0, 0),
                               noise=40, gradient=True, rng=nrng))
        files.append(name)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    recs = [{"id": f"e{i}", "image": rng.choice(files), "conversations": [
        {"from": "human", "value": "<image>\n" + words(5, 30)},
        {"from": "gpt", "value": words(10, 120)}]} for i in range(samples)]
    write_json_list(root / "energon.json", recs)
    folder = export_energon(root / "energon.json", root / "energon", root / "energon_images",
                            shard_size=200).path
    rc = cli_main(["stats", str(folder), "--model", LAYOUTS["internvl"][0], "--tokenizer",
                   str(root / "tokenizer.json"), "--workers", "2", "--out",
                   str(root / "energon_lengths.npz"), "--no-progress", "--max-tiles", "6"])
    if rc:
        raise SystemExit(rc)
    return folder


def _as_it_is(crude: dict) -> dict:
    return crude


class _SameDecoding:
    """Energon's task encoder for its own loader: each crude sample read by Energon's shard
    reader becomes the training sample through the same code as the balanced path (the same
    record, render, tokenizer, image decoding and tiling)."""

    def __init__(self, source, index_of: dict[str, int]) -> None:
        from megatron.energon import Cooker, DefaultTaskEncoder, stateless

        from megatron_omnibal.data.energon.samples import TextDecoder

        self.source, self.index_of = source, index_of
        encoder = DefaultTaskEncoder()
        encoder.decoder = TextDecoder()
        encoder.cookers = [Cooker(stateless(_as_it_is))]  # the crude sample, to encode_sample
        encoder.encode_sample = self.encode_sample
        encoder.batch = self.batch
        self.encoder = encoder

    def encode_sample(self, crude):
        from megatron_omnibal.data.energon.samples import EnergonSample, builtin_record

        key = crude["__key__"]
        members = {k: v for k, v in crude.items() if not k.startswith("__")}
        record, images = builtin_record(crude, "CrudeSample", members, key)
        return self.source(self.index_of[key], 0, EnergonSample(record, images, key, {}))

    @staticmethod
    def batch(samples):
        from megatron_omnibal.megatron.stream.batch import collate

        return collate(samples)


def measure_energon(root: Path, own_loader: bool, workers: int, samples: int,
                    batch: int) -> dict:
    """Samples/s delivered to the training process: the balanced path (planned samples fetched
    by key, packed as planned) or Energon's get_train_dataset + get_loader with the same
    decoding, `batch` samples per batch (the balanced micro-batches' mean)."""
    from megatron_omnibal.balance.config import BalanceConfig
    from megatron_omnibal.balance.sampler import BalancedBatchSampler
    from megatron_omnibal.data.lengths import load_identities, load_lengths
    from megatron_omnibal.megatron.stream.data import BalancedDataIterator
    from megatron_omnibal.megatron.stream.dataset import open_source
    from megatron_omnibal.megatron.stream.iterators import filler_sample
    from megatron_omnibal.megatron.stream.loader import MicroBatchDataset
    from megatron_omnibal.megatron.stream.source import SourceSettings
    from megatron_omnibal.models.presets import get_preset

    preset, _, vit_budget, token_budget = LAYOUTS["internvl"]
    spec = get_preset(preset)
    lengths_path = root / "energon_lengths.npz"
    lengths = load_lengths(lengths_path)
    settings = SourceSettings(data=str(root / "energon"), lengths_path=str(lengths_path))
    source = open_source(settings, lengths, spec, check=0)
    if own_loader:
        from megatron.energon import WorkerConfig, get_loader, get_train_dataset

        index_of = {key: i for i, (_, key) in enumerate(load_identities(lengths_path))}
        config = WorkerConfig(rank=0, world_size=1, num_workers=workers)
        dataset = get_train_dataset(root / "energon", worker_config=config, batch_size=batch,
                                    shuffle_buffer_size=None, max_samples_per_sequence=None,
                                    task_encoder=_SameDecoding(source, index_of).encoder)
        it = iter(get_loader(dataset))
    else:
        config = BalanceConfig(dp_size=1, micro_batches=1, vit_budget=vit_budget,
                               token_budget=token_budget, seed=0)
        sampler = BalancedBatchSampler(lengths, config, dp_rank=0)
        it = BalancedDataIterator(sampler, 1, MicroBatchDataset(
            source, lambda: filler_sample(spec)), num_workers=workers)
    for _ in range(max(1, workers)):  # warm-up: worker start-up and first batches
        next(it)
    done, micro = 0, 0
    wall = time.perf_counter()
    while done < samples:
        done += next(it).num_samples
        micro += 1
    wall = time.perf_counter() - wall
    del it
    return {"loader": "energon get_loader" if own_loader else "balanced", "workers": workers,
            "samples": done, "batches": micro, "samples_per_s": done / wall}


def energon_section(root: Path, args: argparse.Namespace) -> dict:
    """The balanced Energon path against Energon's own loader, interleaved, best of repeats."""
    generate_energon(root, args.energon_samples, args.energon_images, args.seed)
    probe = measure_energon(root, False, 0, 20, 1)
    batch = max(1, round(probe["samples"] / probe["batches"]))
    best: dict[tuple[bool, int], dict] = {}
    for _ in range(args.repeats):
        for workers in (0, 2):
            for own in (False, True):
                r = measure_energon(root, own, workers, args.energon_timed, batch)
                key = (own, workers)
                if key not in best or r["samples_per_s"] > best[key]["samples_per_s"]:
                    best[key] = r
    rows = [best[k] for k in sorted(best, key=lambda k: (k[1], k[0]))]
    print(f"\nEnergon dataset: {args.energon_samples} samples (real JPEG/PNG members, "
          f"{args.energon_images} pictures of 300-800 pixels), "
          f"{args.energon_timed} samples timed per case, Energon batches of {batch}")
    print(f"{'loader':<22}{'workers':>8}{'samples/s':>12}")
    for r in rows:
        print(f"{r['loader']:<22}{r['workers']:>8}{r['samples_per_s']:>12.2f}")
    ratios = {f"balanced_vs_energon_{w}_workers": best[False, w]["samples_per_s"]
              / best[True, w]["samples_per_s"] for w in (0, 2)}
    for w in (0, 2):
        print(f"energon, {w} workers: balanced / Energon's own loader = "
              f"{ratios[f'balanced_vs_energon_{w}_workers']:.2f}x (goal >= 0.9)")
    return {"results": rows, "ratios": ratios, "batch": batch}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--images", type=int, default=120)
    parser.add_argument("--micro-batches", type=int, default=60,
                        help="micro-batches timed per case (first stage)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each first-stage case, interleaved; the best is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--energon-samples", type=int, default=2000,
                        help="samples of the generated Energon dataset (0: no Energon section)")
    parser.add_argument("--energon-images", type=int, default=64,
                        help="pictures the Energon dataset's samples draw from")
    parser.add_argument("--energon-timed", type=int, default=400,
                        help="samples timed per Energon case")
    parser.add_argument("--only-energon", action="store_true",
                        help="run the Energon section alone")
    parser.add_argument("--json", help="write the figures as JSON")
    args = parser.parse_args(argv)
    from megatron_omnibal.cli import main as cli_main

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    results = []
    layouts = {} if args.only_energon else LAYOUTS
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        generate(root, args.samples, args.images, args.seed, videos=bool(layouts))
        for layout, (preset, flags, _, _) in layouts.items():
            data = root / DATA[layout]
            root_flag = ["--image-root", str(root / "images")] if layout == "llava" else []
            rc = cli_main(["stats", str(data), "--model", preset, "--tokenizer",
                           str(root / "tokenizer.json"), "--workers", "2", "--out",
                           str(root / f"{layout}_lengths.npz"), "--no-progress", *root_flag,
                           *flags])
            if rc:
                return rc
        load = os.getloadavg()[0]
        energon = energon_section(root, args) if args.energon_samples else None
        for layout in layouts:
            best: dict[int, dict] = {}
            for _ in range(args.repeats):  # interleaved, so a noisy minute hits every case
                for workers in (0, 1, 2):
                    r = measure(root, layout, True, workers, args.micro_batches)
                    if workers not in best or r["micro_per_s"] > best[workers]["micro_per_s"]:
                        best[workers] = r
            results.extend(best[w] for w in (0, 1, 2))
            results.append(measure(root, layout, False, 0, 10 * args.micro_batches))
            results.append(measure(root, layout, False, 2, 10 * args.micro_batches))
    if layouts:
        print(f"{'layout':<10}{'rank':<13}{'workers':>8}{'micro-batches/s':>17}"
              f"{'samples/micro':>15}{'main-thread CPU ms/sample':>27}")
    for r in results:
        print(f"{r['layout']:<10}{r['rank']:<13}{r['workers']:>8}{r['micro_per_s']:>17.2f}"
              f"{r['samples'] / r['micro_batches']:>15.1f}"
              f"{1000 * r['main_thread_cpu_s_per_sample']:>27.3f}")
    ratios = {}
    for r in results:
        if "decoded_per_trained_frame" in r:
            print(f"{r['layout']}: {r['decoded_per_trained_frame']:.2f} frames decoded per frame "
                  "trained (the 1.5 goal is out of reach under 'rand' sampling of long-GOP video)")
    for layout in layouts:
        rows = {(r["rank"], r["workers"]): r for r in results if r["layout"] == layout}
        base = rows["first stage", 0]["micro_per_s"]
        ratios[layout] = {
            "two_workers_vs_none": rows["first stage", 2]["micro_per_s"] / base,
            "one_worker_vs_none": rows["first stage", 1]["micro_per_s"] / base,
            "two_workers_vs_one": rows["first stage", 2]["micro_per_s"]
            / rows["first stage", 1]["micro_per_s"],
            "later_stage_vs_first_stage": rows["later stage", 0]["micro_per_s"] / base,
        }
        r = ratios[layout]
        print(f"{layout}: 2 workers / none = {r['two_workers_vs_none']:.2f}x (target >= 1.6), "
              f"1 worker / none = {r['one_worker_vs_none']:.2f}x, 2 workers / 1 = "
              f"{r['two_workers_vs_one']:.2f}x, later stage / first stage "
              f"(no workers) = {r['later_stage_vs_first_stage']:.1f}x (target >= 10)")
    print(f"load average before the timings: {load:.1f} ({os.cpu_count()} cores)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "ratios": ratios,
                                               "energon": energon, "load_avg": load,
                                               "args": vars(args)}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
