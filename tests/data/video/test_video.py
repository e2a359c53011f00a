"""Video headers and seeking decode (data/video/reader.py), frame counts and indices
(data/frames.py), on small videos written here with known frame colours."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_omnibal.data.frames import FrameSettings, frame_counts, frame_indices
from megatron_omnibal.data.video.reader import VideoError, decode_frames, read_header
from tests.helpers.video_files import frame_of, write_video


@pytest.mark.parametrize("suffix", ["mp4", "webm", "mkv", "avi"])
def test_header_and_exact_frames_by_seeking(tmp_path, suffix):
    path = write_video(tmp_path / f"v.{suffix}", 90, fps=15, size=(80, 48), gop=10)
    header = read_header(path)
    assert (header.frames, header.fps, header.width, header.height) == (90, 15.0, 80, 48)
    assert header.duration == pytest.approx(6.0)
    assert header.estimated == (suffix in ("webm", "mkv"))  # no count stored: duration x rate
    wanted = [0, 88, 3, 3, 45, 89, 46, 12]
    got = decode_frames(path, wanted)
    assert got.pixels.shape == (len(wanted), 48, 80, 3)
    assert [frame_of(p) % 64 for p in got.pixels] == [k % 64 for k in wanted]
    # seeking: far fewer frames decoded than the video holds (keyframe every 10 frames)
    assert got.decoded <= 45


def test_frames_nothing_refers_to_are_not_decoded_unless_wanted(tmp_path):
    """x264 (MP4) writes B-frames: decoding on through a keyframe interval skips the ones
    not wanted, and the wanted ones (B-frames among them) are still exact."""
    path = write_video(tmp_path / "b.mp4", 90, fps=15, gop=30)
    wanted = [5, 17, 29, 41, 53, 65, 77, 89]
    got = decode_frames(path, wanted)
    assert [frame_of(p) for p in got.pixels] == [k % 64 for k in wanted]
    assert got.decoded < 75  # all 90 frames lie on the way


def test_exactly_the_frames_an_exact_decoder_must_decode(tmp_path):
    """Long GOPs (a keyframe every 60 frames, none between) with B-frames: for each wanted
    frame, the packets from the later of its keyframe and the previous wanted frame are
    decoded (decode order), less the unwanted ones nothing refers to (those FFmpeg's NONREF
    skip leaves out, found by one decode of the whole video): no frame more, no frame less."""
    import av

    path = write_video(tmp_path / "long.mp4", 240, fps=30, gop=60,
                       options={"x264-params": "scenecut=0:keyint=60"})
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        tb = float(stream.time_base)
        packets = [(round(p.pts * tb * 30), p.is_keyframe) for p in container.demux(stream)
                   if p.size]
        container.seek(0)
        stream.codec_context.skip_frame = "NONREF"
        refs = {round(f.pts * tb * 30) for f in container.decode(stream)}
    assert sum(key for _, key in packets) == 4 and len(refs) < 150  # long GOPs, B-frames
    rng = np.random.default_rng(0)
    for _ in range(4):
        wanted = sorted({int(i) for i in rng.choice(240, 8, replace=False)})
        need = set()
        for w in wanted:
            d = next(i for i, (at, _) in enumerate(packets) if at == w)
            k = max(i for i in range(d + 1) if packets[i][1])
            need.update(i for i in range(k, d + 1)
                        if packets[i][0] in refs or packets[i][0] in wanted)
        got = decode_frames(path, wanted)
        assert got.decoded == len(need)
        assert [frame_of(p) for p in got.pixels] == [w % 64 for w in wanted]


def test_a_time_without_a_frame_takes_the_frame_shown_then(tmp_path):
    """A variable-rate video (gaps in its frame times): the frame of a time no frame starts at
    is the last one shown before it, as a player shows it."""
    times = [0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 15, 16, 20, 21, 22, 23]  # in 1/10 s
    path = write_video(tmp_path / "vfr.mkv", len(times), fps=10, gop=4, times=times)
    header = read_header(path)
    assert (header.frames, header.fps) == (24, 10.0)  # duration x rate
    shown = [max(k for k, t in enumerate(times) if t <= at) for at in range(header.frames)]
    for wanted in (list(range(header.frames)), [4, 5, 9, 11, 17, 19]):
        got = decode_frames(path, wanted)
        assert [frame_of(p) for p in got.pixels] == [shown[i] for i in wanted]


def test_bad_videos_name_the_file_and_the_reason(tmp_path):
    with pytest.raises(VideoError, match="no such file"):
        read_header(tmp_path / "missing.mp4")
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video" * 50)
    with pytest.raises(VideoError, match="cannot open video .*junk.mp4"):
        read_header(junk)
    audio = tmp_path / "audio.wav"
    import av

    with av.open(str(audio), "w") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16",
                                           layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    with pytest.raises(VideoError, match="has no video stream"):
        read_header(audio)
    # an MP4 whose index (at the front) promises 60 frames, its data cut behind it: the
    # header reads, decoding the frames past the cut fails
    cut = write_video(tmp_path / "cut.mp4", 60, fps=10,
                      container_options={"movflags": "faststart"})
    data = cut.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    assert read_header(cut).frames == 60
    with pytest.raises(VideoError,
                       match="cut.mp4 (ends after frame .* truncated|fails while decoding)"):
        decode_frames(cut, [5, 55])
    # a WebM stores no count: the frames are counted up to its last packet, and those decode
    cut = write_video(tmp_path / "cut.webm", 60, fps=10)
    data = cut.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    frames = read_header(cut).frames
    assert 10 < frames < 60
    got = decode_frames(cut, [5, frames - 2])
    assert [frame_of(p) for p in got.pixels] == [5, frames - 2]
    with pytest.raises(VideoError, match="frame 60 asked for, the header says 60"):
        decode_frames(write_video(tmp_path / "ok.mp4", 60), [60])


def test_frame_counts_are_a_seeded_uniform_draw_per_epoch():
    settings = FrameSettings()
    frames, fps = np.full(4000, 300), np.full(4000, 30.0)
    a = frame_counts(settings, frames, fps, seed=5, epoch=0)
    assert np.array_equal(a, frame_counts(settings, frames, fps, seed=5, epoch=0))
    assert not np.array_equal(a, frame_counts(settings, frames, fps, seed=5, epoch=1))
    assert a.min() == 8 and a.max() == 32
    assert np.all(np.abs(np.bincount(a, minlength=33)[8:] / len(a) - 1 / 25) < 0.015)
    fixed = FrameSettings(min_frames=16, max_frames=16)
    assert np.all(frame_counts(fixed, frames, fps, seed=5, epoch=3) == 16)
    # fps0.5 over 10 s, 61 s and 2 s: 5, 30 and 1 frames; 200 s is capped at max_frames
    by_time = FrameSettings(sampling="fps0.5")
    got = frame_counts(by_time, np.array([300, 1830, 60]), np.array([30.0, 30.0, 30.0]), 0, 0)
    assert got.tolist() == [5, 30, 1]
    assert frame_counts(by_time, np.array([30 * 200]), np.array([30.0]), 0, 0).tolist() == [32]


def test_frame_indices_follow_internvl_rules():
    rand = FrameSettings()
    idx = frame_indices(rand, 8, 80, 10.0, seed=1, epoch=0, sample=7, video=9)
    assert np.all((idx >= np.arange(8) * 10) & (idx < np.arange(1, 9) * 10))  # one per segment
    assert np.array_equal(idx, frame_indices(rand, 8, 80, 10.0, 1, 0, 7, 9))
    assert not np.array_equal(idx, frame_indices(rand, 8, 80, 10.0, 1, 1, 7, 9))
    middle = FrameSettings(sampling="middle")
    assert frame_indices(middle, 4, 40, 10.0, 0, 0, 0, 0).tolist() == [5, 15, 25, 35]
    # a short video: every frame once, then the last repeated up to the count
    assert frame_indices(middle, 6, 4, 10.0, 0, 0, 0, 0).tolist() == [0, 1, 2, 3, 3, 3]
    # times 0.25, 0.75, 1.25, 1.75 s at 10 frames/s, rounded half to even (InternVL's round)
    assert frame_indices(FrameSettings(sampling="fps2"), 4, 20, 10.0, 0, 0, 0, 0).tolist() == \
        [2, 8, 12, 18]


def test_each_video_and_the_counts_draw_from_their_own_streams():
    rand = FrameSettings()
    # two videos of one sample, of the same length, get independent frames (32 segments of
    # 10 frames: equal picks by chance have probability 1e-32)
    for seed in range(5):
        first, second = (frame_indices(rand, 32, 320, 10.0, seed, 2, 7, video)
                         for video in (3, 4))
        assert not np.array_equal(first, second)
    # the counts of an epoch follow from (seed, epoch) and the video's place alone: not from
    # the videos' lengths or rates
    frames, fps = np.array([90, 4000, 12, 700]), np.array([30.0, 25.0, 5.0, 24.0])
    counts = frame_counts(rand, frames, fps, seed=5, epoch=1)
    assert np.array_equal(counts, frame_counts(rand, frames[::-1] * 3, fps / 2, 5, 1))
    assert np.array_equal(counts[:2], frame_counts(rand, frames[:2], fps[:2], 5, 1))
    assert not np.array_equal(counts, frame_counts(rand, frames, fps, seed=6, epoch=1))
    with pytest.raises(ValueError, match="rand, middle or fpsX"):
        FrameSettings(sampling="every2")
    with pytest.raises(ValueError, match="min_frames <= max_frames"):
        FrameSettings(min_frames=9, max_frames=8)


def test_epoch_lengths_by_hand_and_files_without_videos(tmp_path):
    from megatron_omnibal.data.lengths import VideoTable, from_arrays, load_videos, save_lengths
    from megatron_omnibal.data.sample.config import StatsConfig, config_from_dict, config_to_dict
    from megatron_omnibal.data.video_lengths import (
        EpochLengths,
        VideoPlan,
        run_lengths,
        with_frame_counts,
    )

    # sample 0 text-only, 1 one video of 3 frames, 2 two videos of 2 and 4 frames
    lengths = from_arrays([1, 3, 6], [50, 500, 900], [0, 3, 6])
    table = VideoTable(np.array([1, 2, 2]), np.array([90, 40, 7]), np.array([30.0, 10, 7]),
                       np.array([3, 2, 4]))
    plan = VideoPlan(frames=FrameSettings(min_frames=2, max_frames=5),
                     frame_tokens=(100, 110, 111, 112, 113))
    got = with_frame_counts(lengths, table, plan, np.array([5, 2, 2]))
    assert got.vit.tolist() == [1, 5, 4] and got.image_flags.tolist() == [0, 5, 4]
    # frame k adds frame_tokens[k-1]: 3 -> 5 frames adds frames 4 and 5; 4 -> 2 drops 3 and 4
    assert got.tokens.tolist() == [50, 500 + 112 + 113, 900 - 111 - 112]
    by_epoch = EpochLengths(lengths, table, plan, seed=3)
    # an epoch's lengths are the checked rule above applied to that epoch's drawn counts
    counts = frame_counts(plan.frames, table.frames, table.fps, seed=3, epoch=1)
    expected = with_frame_counts(lengths, table, plan, counts)
    for field in ("vit", "tokens", "image_flags"):
        assert np.array_equal(getattr(by_epoch(1), field), getattr(expected, field))
    assert np.array_equal(by_epoch.frame_counts(1), counts)
    # a file written without videos (as before they existed) loads with an empty table, and
    # training's lengths are the file's in every epoch
    save_lengths(lengths, tmp_path / "old.npz")
    save_lengths(lengths, tmp_path / "old.json")
    for name in ("old.npz", "old.json"):
        assert len(load_videos(tmp_path / name)) == 0
        same = run_lengths(tmp_path / name, lengths, seed=1)
        assert same(4) is lengths
    save_lengths(lengths, tmp_path / "new.jsonl", videos=table)
    assert np.array_equal(load_videos(tmp_path / "new.jsonl").tiles, table.tiles)
    # a stored configuration from before videos has no frame settings: the defaults
    doc = config_to_dict(StatsConfig(tokenizer="t"), {})
    del doc["frames"], doc["frame_seed"]
    config, _ = config_from_dict(doc, "old")
    assert config.frames == FrameSettings() and config.frame_seed == 0
