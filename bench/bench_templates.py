"""CPU of `omnibal stats` with a checkpoint's own chat template (`hf`) against the built-in
template of the same format, side by side in one run.

Why: `hf` renders each conversation with Jinja turn by turn (or tokenizes once more inside
transformers where the template has generation markers) to find the answers' spans; the
built-in templates build the text directly. The ratio says what the checkpoint's own template
costs on the statistics pass.

Text-only two-round conversations with a tiny byte-level tokenizer carrying Qwen2.5-VL's and
llava-hf's template forms (tests/helpers/chat_templates.py), one worker, best of --repeat runs:

    python bench/bench_templates.py --samples 3000 --json templates.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_omnibal.data.sample.config import StatsConfig  # noqa: E402
from megatron_omnibal.data.stats.compute import compute_stats  # noqa: E402
from megatron_omnibal.data.text import conversations as conv  # noqa: E402
from tests.helpers import chat_templates as ct  # noqa: E402

# (family, checkpoint template, its special tokens, image style, tokenizer's BOS, built-in)
FAMILIES = [("qwen2_5_vl", ct.QWEN2_5_VL, ct.QWEN_SPECIALS, conv.QWEN_VL_IMAGE, None, "qwen2_vl"),
            ("llava_hf", ct.LLAVA_HF, ct.LLAVA_SPECIALS, conv.LLAVA_IMAGE, "<s>", "vicuna_v1")]


def write_conversations(path: Path, samples: int, seed: int) -> None:
    """Two rounds of 5-60 words per turn."""
    rng = random.Random(seed)
    turns = ("human", "gpt", "human", "gpt")
    records = [{"id": str(i), "conversations": [
        {"from": who, "value": " ".join(rng.choice(ct.WORDS) for _ in range(rng.randint(5, 60)))}
        for who in turns]} for i in range(samples)]  # fmt: skip
    path.write_text(json.dumps(records))


def best_seconds(data: Path, config: StatsConfig, repeat: int) -> float:
    compute_stats(data, config, progress=False, workers=1)  # warm: tokenizer, template compile
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        compute_stats(data, config, progress=False, workers=1)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=2, help="runs per case; the best counts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "data.json"
        write_conversations(data, args.samples, args.seed)
        for family, template, specials, style, bos, builtin in FAMILIES:
            extra = {"bos": bos} if bos else {}
            tokenizer = ct.byte_level_tokenizer(root / family, template, specials, **extra)
            ms = {}
            for name in ("hf", builtin):
                config = StatsConfig(tokenizer=str(tokenizer), template=name, image_style=style)
                ms[name] = best_seconds(data, config, args.repeat) / args.samples * 1e3
            rows.append({"family": family, "builtin": builtin, "hf_ms_per_sample": ms["hf"],
                         "builtin_ms_per_sample": ms[builtin], "ratio": ms["hf"] / ms[builtin]})
            print(f"{family}: hf {ms['hf']:.2f} ms/sample, {builtin} {ms[builtin]:.2f} ms/sample "
                  f"({ms['hf'] / ms[builtin]:.1f}x)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": args.samples, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
