"""Megatron-Energon datasets built in tests: WebDataset shards of real images written with
Pillow, prepared by Energon's own `energon prepare` (its CLI, in this process), and the same
samples as a LLaVA JSON list with image files, the oracle form."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from megatron_omnibal.data.formats.generate import image_array, save_image

VQA_FIELD_MAP = {"image": "jpg", "context": "json[0][value]", "answers": "json[1][value]"}


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def write_vqa_dataset(root: Path, name: str, sizes: list[tuple[int, int]], texts: list[tuple],
                      per_shard: int = 4) -> tuple[Path, Path]:
    """Single-image VQA samples as Megatron-LM's VLM recipe writes them (`KEY.jpg`, and
    `KEY.json` holding the conversation), in shards of `per_shard`; and the same samples as a
    LLaVA JSON list whose images are files. Returns (shard folder, JSON file)."""
    folder = root / name
    images = root / f"{name}_images"
    folder.mkdir(parents=True)
    images.mkdir()
    records = []
    for start in range(0, len(sizes), per_shard):
        with tarfile.open(folder / f"part-{start // per_shard:04d}.tar", "w") as tf:
            for k in range(start, min(start + per_shard, len(sizes))):
                w, h = sizes[k]
                key = f"{name}_{k:05d}"
                save_image(images / f"{key}.jpg", image_array(w, h, (k * 37 % 255, 90, 200)))
                question, answer = texts[k]
                conversation = [{"from": "human", "value": f"<image>\n{question}"},
                                {"from": "gpt", "value": answer}]
                _add(tf, f"{key}.jpg", (images / f"{key}.jpg").read_bytes())
                _add(tf, f"{key}.json", json.dumps(conversation).encode())
                records.append({"id": key, "image": f"{name}_images/{key}.jpg",
                                "conversations": conversation})
    annotation = root / f"{name}.json"
    annotation.write_text(json.dumps(records))
    return folder, annotation


def energon_prepare(folder: Path, *extra: str) -> None:
    """Energon's own `energon prepare`, non-interactive, everything in the train split."""
    from megatron.energon.cli.main import main

    main(["prepare", str(folder), "--non-interactive", "--split-ratio", "1,0,0",
          "--num-workers", "1", "--no-progress", "--force-overwrite", *extra],
         standalone_mode=False)


def prepare_vqa(folder: Path, media_metadata: bool = True) -> None:
    energon_prepare(folder, "--sample-type", "VQASample", "--field-map",
                    json.dumps(VQA_FIELD_MAP),
                    *(["--media-metadata-by-extension"] if media_metadata else []))


def save_png(path: Path, size: tuple[int, int]) -> None:
    save_image(path, image_array(size[0], size[1], (10, 200, 30)))
