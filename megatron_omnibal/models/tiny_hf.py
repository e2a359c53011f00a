"""A tiny random Hugging Face InternVL checkpoint with its own tokenizer, written on the fly.

Why: `omnibal finetune` starts from a Hugging Face directory, and the demo and the tests may
download nothing. The checkpoint is transformers' own `internvl` (an InternViT-300M-like tower,
a Qwen2 LLM) a few layers deep, with the tokenizer of a generated dataset (data/formats/generate.py)
saved beside it and InternVL's image tokens added to it, so `omnibal stats --model DIR` reads
tiling, template and tokenizer from the directory as it does for a real release.

    python -m megatron_omnibal.models.tiny_hf OUT_DIR --tokenizer TOKENIZER_JSON [--seed S]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_omnibal.cli_args import non_negative_int, output_dir, positive_int

IMAGE_TOKENS = ("<img>", "<IMG_CONTEXT>", "</img>")


def write_tiny_internvl(
    out: str | Path, tokenizer_json: str | Path, *, llm_layers: int = 4, seed: int = 0
) -> Path:
    """Save the model (16-pixel tiles of 4-pixel patches: 4 tokens per tile) and the tokenizer
    into `out`; the vocabulary is the tokenizer's, image tokens included."""
    import torch
    from tokenizers import Tokenizer
    from transformers import (
        GotOcr2ImageProcessor,
        InternVLConfig,
        InternVLForConditionalGeneration,
        PreTrainedTokenizerFast,
        Qwen2Config,
    )
    from transformers.models.internvl.configuration_internvl import InternVLVisionConfig

    out = Path(out)
    backend = Tokenizer.from_file(str(tokenizer_json))
    backend.add_special_tokens(list(IMAGE_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    vision = InternVLVisionConfig(
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        norm_type="layer_norm",
        use_qk_norm=False,
        attention_bias=True,
        use_mean_pooling=True,
        layer_norm_eps=1e-6,
    )
    text = Qwen2Config(
        hidden_size=32,
        num_hidden_layers=llm_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=backend.get_vocab_size(),
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    config = InternVLConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_id=backend.token_to_id("<IMG_CONTEXT>"),
        image_seq_length=4,
        downsample_ratio=0.5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    InternVLForConditionalGeneration(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    GotOcr2ImageProcessor(size={"height": 16, "width": 16}, max_patches=6).save_pretrained(out)
    return out.resolve()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_omnibal.models.tiny_hf",
        description="write a tiny random transformers InternVL checkpoint with a tokenizer",
    )
    parser.add_argument("out", type=output_dir, help="folder to write into (created)")
    parser.add_argument("--tokenizer", required=True, help="a tokenizers JSON file")
    parser.add_argument("--llm-layers", type=positive_int, default=4)
    parser.add_argument("--seed", type=non_negative_int, default=0)
    args = parser.parse_args(argv)
    path = write_tiny_internvl(args.out, args.tokenizer, llm_layers=args.llm_layers, seed=args.seed)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
