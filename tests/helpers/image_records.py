"""ShareGPT records over generated images, as the Qwen-style stats tests count them: one
record per image, a record with two images, a text-only record."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from megatron_omnibal.data.formats.generate import image_array, save_image

ASK = [{"from": "human", "value": "<image>\nwhat is in this picture ?"},
       {"from": "gpt", "value": "a cat , 3 ."}]  # fmt: skip


def image_records(
    root: Path, sizes: Sequence[tuple[int, int]], suffix: Callable[[int], str] = lambda k: "png"
) -> tuple[list[str], list[dict]]:
    """(image paths relative to `root`, records): image k of `sizes` (width, height) saved under
    root/img as `suffix(k)`."""
    (root / "img").mkdir()
    names = []
    for k, (w, h) in enumerate(sizes):
        names.append(f"img/{k}.{suffix(k)}")
        save_image(root / names[-1], image_array(w, h, (k * 20, 90, 200)))
    recs = [{"id": f"one{k}", "image": n, "conversations": ASK} for k, n in enumerate(names)]
    recs.append({"id": "two", "image": names[:2], "conversations": [
        {"from": "human", "value": "<image> and <image> : the value ?"},
        {"from": "gpt", "value": "2"}]})  # fmt: skip
    recs.append({"id": "text", "conversations": [{"from": "human", "value": "what year ?"},
                                                 {"from": "gpt", "value": "1 2 3"}]})
    return names, recs


def write_records(path: Path, recs: list[dict]) -> Path:
    path.write_text(json.dumps(recs))
    return path
