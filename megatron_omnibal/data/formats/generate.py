"""Small VLM datasets of real image files, written on the fly.

Why: the demo, the tests and the benchmarks need what a user brings (JPEG/PNG files,
annotations in the LLaVA or InternVL format, a tokenizer) and may download nothing. The
writers here are the one copy they share. `qa_dataset` writes a dataset whose answers follow
from the question and the image (colour, shape, counting), so a model trained on it learns
visibly: the demo's loss falls.

    python -m megatron_omnibal.data.formats.generate OUT_DIR [--samples N] [--images N] [--seed S]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from megatron_omnibal.cli_args import non_negative_int, output_dir, positive_int

# The chat template's markers and the InternVL image tokens: special tokens of every tokenizer
# trained here, so a template or an image marker is one token, never split by BPE.
TEMPLATE_SPECIALS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")


def image_array(
    width: int,
    height: int,
    colour: tuple[int, int, int] = (0, 0, 0),
    *,
    noise: int = 0,
    gradient: bool = False,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """An RGB image: a flat `colour`, or a red/green gradient (`gradient`, blue from `colour`),
    plus uniform noise in [0, noise) per pixel and channel, so JPEG has real content to code."""
    pixels = np.empty((height, width, 3), np.int64)
    pixels[:] = colour
    if gradient:
        y, x = np.mgrid[0:height, 0:width]
        pixels[..., 0] = x * 255 // width
        pixels[..., 1] = y * 255 // height
    if noise:
        rng = rng if rng is not None else np.random.default_rng(0)
        pixels += rng.integers(0, noise, (height, width, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)


def save_image(path: str | Path, pixels: np.ndarray, quality: int = 85) -> None:
    """PNG (fast compression) or JPEG at `quality`, by the file's suffix."""
    from PIL import Image

    image = Image.fromarray(pixels, "RGB")
    if Path(path).suffix.lower() == ".png":
        image.save(path, compress_level=1)
    else:
        image.save(path, quality=quality)


def train_tokenizer(
    corpus: Iterable[str],
    vocab_size: int,
    special_tokens: Sequence[str] = TEMPLATE_SPECIALS,
    *,
    byte_level: bool = False,
    bos: bool = False,
) -> Any:
    """A BPE tokenizer (tokenizers.Tokenizer) trained on `corpus`: whitespace-split words with
    an <unk> token, or byte-level (every string encodes); `bos` prepends <s> to every encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(special_tokens),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in special_tokens else None))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False
        )
    tok.train_from_iterator(corpus, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return tok


def write_video(path: str | Path, codec: str, frames: int, fps: int, size: tuple[int, int],
                gop: int, picture: Callable[[int], np.ndarray],
                options: dict[str, str] | None = None,
                times: Sequence[int] | None = None,
                container_options: dict[str, str] | None = None) -> Path:
    """A video of `frames` frames, frame k's RGB pixels (uint8 [height, width, 3]) being
    `picture(k)`, encoded with `codec` at `fps` frames/s and a keyframe at least every `gop`
    frames. `times` (in 1/fps units, rising) gives frame k's time for a variable-rate video
    (default: k); `container_options` are the muxer's (e.g. MP4's movflags)."""
    import av

    width, height = size
    with av.open(str(path), "w", options=container_options or {}) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        stream.codec_context.gop_size = gop
        if options:
            stream.options = options
        for k in range(frames):
            frame = av.VideoFrame.from_ndarray(picture(k), format="rgb24")
            if times is not None:
                frame.pts, frame.time_base = int(times[k]), Fraction(1, fps)
            out.mux(stream.encode(frame))
        out.mux(stream.encode())
    return Path(path)


def write_json_list(path: str | Path, records: list[dict], indent: int | None = None) -> None:
    """A LLaVA-style annotation file: one JSON list of records (`indent`: a record over
    several lines, so error reports name different lines)."""
    Path(path).write_text(json.dumps(records, indent=indent))


def write_jsonl(path: str | Path, records: list[dict]) -> None:
    """An InternVL-style annotation file: one record per line."""
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


def write_meta(path: str | Path, datasets: dict[str, dict]) -> None:
    """An InternVL meta file: dataset name -> {"root", "annotation", "repeat_time"?, ...}
    (relative paths are read from the meta file's folder)."""
    Path(path).write_text(json.dumps(datasets, indent=1))


# --- the demo's learnable dataset ---------------------------------------------------------------

COLOURS = {
    "red": (210, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 210),
    "yellow": (220, 200, 40),
}
NUMBERS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]
SYSTEM_PROMPT = "answer the question ."  # `omnibal stats --system-prompt`: words it knows
SIDES = (16, 24, 32, 48, 64, 96)  # pixels: 1 to 6 tiles of 16 (plus the thumbnail) per side


@dataclass(frozen=True, kw_only=True)
class QADataset:
    """What qa_dataset wrote (paths absolute) and how many records of each kind."""

    meta: Path
    tokenizer: Path
    images: int
    samples: int
    kinds: dict[str, int]


def _shape(width: int, height: int) -> str:
    return "wide" if width >= 1.5 * height else "tall" if height >= 1.5 * width else "square"


def _turn(human: str, answer: str) -> list[dict]:
    return [{"from": "human", "value": human}, {"from": "gpt", "value": answer}]


def _picture_record(i: int, rng: random.Random, pictures: list[tuple[str, str, str]]) -> dict:
    """One of four picture questions; the answer is the picture's colour, shape or both."""
    name, colour, shape = rng.choice(pictures)
    kind = i % 4
    if kind == 0:
        conv = _turn("<image>\nwhat colour is the picture ?", f"it is {colour} .")
    elif kind == 1:
        conv = _turn("<image>\nis the picture wide , tall or square ?", f"it is {shape} .")
    elif kind == 2:
        conv = _turn("<image>\nwhat colour is the picture ?", f"it is {colour} .") + _turn(
            "and is it wide , tall or square ?", f"it is {shape} ."
        )
    else:
        other, colour2, _ = rng.choice(pictures)
        answer = "yes" if colour == colour2 else "no"
        conv = _turn("<image>\n<image>\nare the two pictures the same colour ?", f"{answer} .")
        return {"id": f"picture-{i}", "image": [name, other], "conversations": conv}
    return {"id": f"picture-{i}", "image": name, "conversations": conv}


def _number_record(i: int, rng: random.Random) -> dict:
    """Text only: count between two numbers, or name the next one."""
    if i % 2:
        first = rng.randrange(len(NUMBERS) - 1)
        last = rng.randrange(first + 1, len(NUMBERS))
        conv = _turn(
            f"count from {NUMBERS[first]} to {NUMBERS[last]} .",
            " ".join(NUMBERS[first : last + 1]) + " .",
        )
    else:
        n = rng.randrange(len(NUMBERS) - 1)
        conv = _turn(f"what comes after {NUMBERS[n]} ?", f"{NUMBERS[n + 1]} .")
    return {"id": f"number-{i}", "conversations": conv}


def qa_dataset(root: str | Path, samples: int, images: int, seed: int = 0) -> QADataset:
    """An InternVL meta dataset under `root` whose answers follow from question and image.

    Writes `images` JPEG/PNG pictures (a flat colour with noise, 16 to 96 pixels a side, so 1
    to 7 tiles of 16 pixels), `pictures.jsonl` (3/4 of the samples: questions about the colour,
    the shape, both in two turns, or two pictures' colours) and `numbers.jsonl` (text only:
    counting), `meta.json` naming both, and `tokenizer.json` trained on the words used.
    """
    root = Path(root)
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    pictures = []
    for k in range(images):
        width, height = rng.choice(SIDES), rng.choice(SIDES)
        colour = rng.choice(list(COLOURS))
        name = f"{k:04d}.{'png' if k % 4 == 0 else 'jpg'}"
        save_image(
            root / "images" / name, image_array(width, height, COLOURS[colour], noise=60, rng=nrng)
        )
        pictures.append((name, colour, _shape(width, height)))
    n_pictures = (3 * samples) // 4
    picture_records = [_picture_record(i, rng, pictures) for i in range(n_pictures)]
    number_records = [_number_record(i, rng) for i in range(samples - n_pictures)]
    write_jsonl(root / "pictures.jsonl", picture_records)
    write_jsonl(root / "numbers.jsonl", number_records)
    write_meta(
        root / "meta.json",
        {
            "pictures": {"root": "images", "annotation": "pictures.jsonl"},
            "numbers": {"root": "images", "annotation": "numbers.jsonl"},
        },
    )
    corpus = [
        m["value"].replace("<image>", "")
        for r in picture_records + number_records
        for m in r["conversations"]
    ]
    corpus += [f"system user assistant {SYSTEM_PROMPT}"] * len(corpus)  # the template's words
    train_tokenizer(corpus, vocab_size=120).save(str(root / "tokenizer.json"))
    return QADataset(
        meta=(root / "meta.json").resolve(),
        tokenizer=(root / "tokenizer.json").resolve(),
        images=images,
        samples=samples,
        kinds={"pictures": len(picture_records), "numbers": len(number_records)},
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_omnibal.data.formats.generate",
        description="write the demo's learnable InternVL-format dataset (images, JSONL, meta, "
        "tokenizer)",
    )
    parser.add_argument("out", type=output_dir, help="folder to write into (created)")
    parser.add_argument("--samples", type=positive_int, default=1200)
    parser.add_argument("--images", type=positive_int, default=300)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    args = parser.parse_args(argv)
    made = qa_dataset(args.out, args.samples, args.images, args.seed)
    kinds = ", ".join(f"{n} {k}" for k, n in made.kinds.items())
    print(
        f"{made.samples} samples ({kinds}) over {made.images} JPEG/PNG images; "
        f"wrote {made.meta} and {made.tokenizer}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
