"""Video decoding of the training loader against the exact-frame bound and against torchcodec.

For each sample (a video and the frames InternVL's rule draws for it: `--min-frames` to
`--max-frames` frames, `--frame-sampling`, one draw per sample as training draws them), in one
run and on the same videos and frame indices:

- frames decoded by the loader (data/video/tiles.py: data/video/reader.py's exact decoder, the
  frames resized to one tile (Pillow bicubic) and normalised with the model's mean and std, as
  training does) against the exact-frame bound, computed from each video's packet index: for
  each wanted frame, the packets from the later of its keyframe and the previous wanted frame
  (in decode order, so a B-frame's references count), less the frames nothing refers to that
  are not wanted (found by one decode of the video with FFmpeg's `skip_frame` NONREF, the
  mechanism the decoder drops them with). Goal: decoded <= 1.05x the bound.
- samples/s of that loader against torchcodec's `VideoDecoder(path, seek_mode="exact")
  .get_frames_at(indices)` with the frames resized and normalised by the same function, each
  through a torch DataLoader with each of `--workers` worker counts (best of `--repeats`
  interleaved runs). Goal: ours >= torchcodec's at every worker count. torchcodec is the
  bench's anchor, not a dependency of the package: bench/setup_video_bench.sh installs it.

Without `--videos`, the bench writes long-GOP videos (a keyframe every 8-10 s, no scene-cut
keyframes; H.264 with B-frames in MP4 and MKV, VP8 and VP9 in WebM; 240p-480p, 8-40 s) in a
temp dir; with it, every video file under DIR is used (`--samples-per-video` draws each).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_video.py --workers 0,2 --json video.json
    .venv/bin/python bench/bench_video.py --videos DIR --min-frames 8 --max-frames 32 \\
        --workers 0,2 --json OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SUFFIXES = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".ts")
# (file, codec, seconds, width x height, frames/s, keyframe interval in frames)
VIDEOS = [("g0.mp4", "libx264", 20, (640, 360), 30, 300),
          ("g1.mkv", "libx264", 30, (640, 360), 25, 250),
          ("g2.webm", "libvpx", 20, (426, 240), 30, 300),
          ("g3.mp4", "libx264", 40, (854, 480), 30, 240),
          ("g4.mp4", "libx264", 8, (426, 240), 30, 240),
          ("g5.webm", "libvpx-vp9", 15, (426, 240), 25, 250)]


def write_long_gop_video(path: Path, codec: str, seconds: int, size: tuple[int, int], fps: int,
                         gop: int) -> None:
    """A moving colour gradient with a keyframe every `gop` frames and none between (x264's
    scene-cut keyframes off), B-frames as x264 writes them."""
    from bench_data import gradient_frames

    from megatron_omnibal.data.formats.generate import write_video

    options = {"libx264": {"preset": "superfast", "x264-params": f"scenecut=0:keyint={gop}"},
               "libvpx": {"deadline": "realtime", "cpu-used": "8"},
               "libvpx-vp9": {"deadline": "realtime", "cpu-used": "8"}}[codec]
    write_video(path, codec, seconds * fps, fps, size, gop, gradient_frames(size), options)


def packet_index(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(frame index, keyframe, nothing refers to it) per packet of the video stream, in decode
    order; the last by one decode with skip_frame NONREF (the frames it leaves out)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate or stream.guessed_rate)
        base, tb = stream.start_time or 0, float(stream.time_base)

        def index(ts: int) -> int:
            return int(round((ts - base) * tb * fps))

        at, key = [], []
        for packet in container.demux(stream):
            ts = packet.pts if packet.pts is not None else packet.dts
            if packet.size and ts is not None:
                at.append(index(ts))
                key.append(packet.is_keyframe)
        container.seek(base, stream=stream, backward=True)
        stream.codec_context.skip_frame = "NONREF"
        kept = {index(f.pts) for f in container.decode(stream) if f.pts is not None}
    at_arr = np.asarray(at, np.int64)
    return at_arr, np.asarray(key, bool), ~np.isin(at_arr, list(kept))


def bound_frames(index: tuple[np.ndarray, np.ndarray, np.ndarray], wanted: np.ndarray) -> int:
    """Fewest frames an exact decoder decodes for `wanted`: the union over wanted frames of the
    packets from its keyframe to it (decode order), less the unwanted ones nothing refers to."""
    at, key, nonref = index
    need = np.zeros(len(at), bool)
    targets = set()
    order = np.argsort(at, kind="stable")
    for w in sorted({int(x) for x in wanted}):
        k = np.searchsorted(at[order], w, side="right") - 1  # the frame shown at w
        d = int(order[max(k, 0)])
        targets.add(d)
        start = int(np.flatnonzero(key[:d + 1])[-1]) if key[:d + 1].any() else 0
        need[start:d + 1] = True
    keep = need & ~nonref
    keep[list(targets)] = True
    return int(keep.sum())


class Samples:
    """A torch map-style dataset: sample i -> (float32 tiles [frames, 3, tile, tile], frames
    decoded), by our loader's function or by torchcodec's exact decoder."""

    def __init__(self, items: list[tuple[str, np.ndarray]], tiling, torchcodec: bool) -> None:
        self.items, self.tiling, self.torchcodec = items, tiling, torchcodec

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        import torch

        from megatron_omnibal.data.video.tiles import frames_to_tiles, video_tiles

        path, indices = self.items[i]
        if self.torchcodec:
            from torchcodec.decoders import VideoDecoder

            frames = VideoDecoder(path, seek_mode="exact").get_frames_at(indices.tolist())
            tiles = frames_to_tiles(frames.data.permute(0, 2, 3, 1).numpy(), self.tiling)
            return torch.from_numpy(tiles), -1
        tiles, decoded = video_tiles(path, indices, self.tiling)
        return torch.from_numpy(tiles), decoded


def run_loader(dataset: Samples, workers: int) -> tuple[float, int]:
    """(samples/s, frames decoded) of one pass over `dataset` with `workers` workers."""
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=None, shuffle=False, num_workers=workers)
    start, decoded = time.perf_counter(), 0
    for _, count in loader:
        decoded += int(count)
    return len(dataset) / (time.perf_counter() - start), decoded


def draw(videos: list[Path], per_video: int, settings, seed: int) -> list[tuple[str, np.ndarray]]:
    """(path, frame indices) per sample: each video `per_video` times, each a sample of its own
    with its own draw (data/frames.py, epoch 0 of `seed`)."""
    from megatron_omnibal.data.frames import frame_counts, frame_indices
    from megatron_omnibal.data.video.reader import read_header

    paths = [p for p in videos for _ in range(per_video)]
    headers = {p: read_header(p) for p in videos}
    frames = np.array([headers[p].frames for p in paths])
    fps = np.array([headers[p].fps for p in paths])
    counts = frame_counts(settings, frames, fps, seed, 0)
    return [(str(p), frame_indices(settings, int(c), int(n), float(r), seed, 0, s, s))
            for s, (p, c, n, r) in enumerate(zip(paths, counts, frames, fps, strict=True))]


def model_tiling(name: str):
    from megatron_omnibal.models.data_side import model_data_side
    from megatron_omnibal.models.presets import get_preset

    return model_data_side(get_preset(name)).tiling


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--videos", type=Path, default=None,
                   help="a folder of videos (default: long-GOP videos written in a temp dir)")
    p.add_argument("--min-frames", type=int, default=8)
    p.add_argument("--max-frames", type=int, default=32)
    p.add_argument("--frame-sampling", default="rand")
    p.add_argument("--samples-per-video", type=int, default=4)
    p.add_argument("--workers", default="0,2", help="DataLoader worker counts, comma-separated")
    p.add_argument("--model", default="internvl2-8b",
                   help="the preset whose tile size, mean and std the frames get")
    p.add_argument("--tile", type=int, default=None, help="tile size (default: the model's)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from dataclasses import replace

    from megatron_omnibal.data.frames import FrameSettings

    try:
        import torchcodec
    except (ImportError, OSError) as exc:
        print(f"bench_video: torchcodec does not import ({type(exc).__name__}: {exc}); run "
              "bench/setup_video_bench.sh", file=sys.stderr)
        return 2
    tiling = model_tiling(args.model)
    if args.tile:
        tiling = replace(tiling, tile=args.tile)
    settings = FrameSettings(min_frames=args.min_frames, max_frames=args.max_frames,
                             sampling=args.frame_sampling)
    workers = [int(w) for w in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.videos is None:
            start = time.perf_counter()
            for name, codec, seconds, size, fps, gop in VIDEOS:
                write_long_gop_video(Path(tmp) / name, codec, seconds, size, fps, gop)
            print(f"wrote {len(VIDEOS)} long-GOP videos in {time.perf_counter() - start:.0f} s",
                  flush=True)
            folder = Path(tmp)
        else:
            folder = args.videos
        videos = sorted(f for f in folder.rglob("*") if f.suffix.lower() in SUFFIXES)
        if not videos:
            print(f"bench_video: no video ({', '.join(SUFFIXES)}) under {folder}",
                  file=sys.stderr)
            return 2
        items = draw(videos, args.samples_per_video, settings, args.seed)
        indexes = {path: packet_index(Path(path)) for path, _ in items}
        bound = sum(bound_frames(indexes[path], idx) for path, idx in items)
        trained = sum(len(idx) for _, idx in items)
        ours, theirs = Samples(items, tiling, False), Samples(items, tiling, True)
        # the same frames: our tiles against torchcodec's, on the first sample of each video
        diff = max(float(np.abs(ours[i][0].numpy() - theirs[i][0].numpy()).max())
                   for i in range(0, len(items), args.samples_per_video))
        rates: dict[str, dict[str, float]] = {"ours": {}, "torchcodec": {}}
        decoded: dict[str, int] = {}
        for w in workers:
            best = {"ours": 0.0, "torchcodec": 0.0}
            for _ in range(args.repeats):
                rate, count = run_loader(ours, w)
                best["ours"] = max(best["ours"], rate)
                decoded[str(w)] = count
                best["torchcodec"] = max(best["torchcodec"], run_loader(theirs, w)[0])
            rates["ours"][str(w)], rates["torchcodec"][str(w)] = best["ours"], best["torchcodec"]
            print(f"workers {w}: ours {best['ours']:.2f} samples/s, torchcodec "
                  f"{best['torchcodec']:.2f} samples/s ({best['ours'] / best['torchcodec']:.2f}x)",
                  flush=True)
    first = decoded[str(workers[0])]
    result = {
        "videos": [str(v.name) for v in videos], "samples": len(items), "tile": tiling.tile,
        "frames": [args.min_frames, args.max_frames], "frame_sampling": args.frame_sampling,
        "trained_frames": trained, "bound_frames": bound, "decoded_frames": first,
        "decoded_over_bound": first / bound, "decoded_frames_by_workers": decoded,
        "samples_per_s": rates["ours"], "torchcodec_samples_per_s": rates["torchcodec"],
        "ratio": {w: rates["ours"][w] / rates["torchcodec"][w] for w in rates["ours"]},
        "max_abs_tile_difference": diff, "torchcodec_version": torchcodec.__version__,
        "repeats": args.repeats,
    }
    print(f"frames per epoch: trained {trained}, exact-frame bound {bound}, decoded {first} "
          f"({first / bound:.3f}x the bound; goal <= 1.05); tiles vs torchcodec's: max "
          f"|difference| {diff:.3g}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
