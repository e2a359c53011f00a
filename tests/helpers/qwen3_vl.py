"""A tiny random Qwen3-VL (transformers' own classes), its model spec, and transformers'
forward and gradients as the oracle of the Megatron stages.

The tower: 4 layers of width 32 (4 heads), patch 4, temporal patch 2, 2x2 merge, a 4x4
position table (images of 2 to 8 patches per side resample it up and down), DeepStack taps
after ViT layers 0, 2 and 3, listed as [2, 0, 3] (transformers pairs merger k with the k-th
listed layer but feeds the taps to LLM layers 0, 1, 2 in layer order); the LLM: Qwen3 with 4
layers, GQA (4 heads, 2 KV groups, head size 16 on width 32), per-head QK-norm and interleaved
M-RoPE with section [4, 2, 2] (the height and width pairs cut off before the last pair, as in
the released [24, 20, 20]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

IMAGE_TOKEN = 255

SPEC = {
    "name": "tiny-qwen3-vl",
    "vit": {
        "num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
        "image_size": 8, "patch_size": 4, "norm": "layernorm", "norm_eps": 1e-6,
        "activation": "gelu_tanh", "qkv_bias": True, "class_token": False, "patch_bias": True,
        "gated_mlp": False, "native_resolution": True, "temporal_patch_size": 2,
        "spatial_merge_size": 2, "window_size": 0, "rope_theta": 10000.0,
        "num_position_embeddings": 16, "deepstack_indexes": [2, 0, 3],
    },
    "projector": {
        "type": "patch_merger", "downsample": 0.5, "hidden_size": 128, "norm_eps": 1e-6,
        "activation": "gelu", "bias": True, "merger_norm": "layernorm",
    },
    "llm": {
        "num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 4,
        "num_query_groups": 2, "kv_channels": 16, "vocab_size": 256, "norm": "rmsnorm",
        "norm_eps": 1e-6, "activation": "silu", "gated_mlp": True, "qk_norm": True,
        "rotary_base": 10000.0, "max_position_embeddings": 4096,
        "mrope_section": [4, 2, 2], "mrope_interleaved": True,
    },
    "image_token_id": IMAGE_TOKEN,
}  # fmt: skip


def hf_config():  # noqa: ANN201 - transformers' Qwen3VLConfig
    from transformers import Qwen3VLConfig

    v, t = SPEC["vit"], SPEC["llm"]
    return Qwen3VLConfig(
        vision_config={
            "depth": v["num_layers"], "hidden_size": v["hidden_size"],
            "intermediate_size": v["ffn_hidden_size"], "num_heads": v["num_attention_heads"],
            "patch_size": v["patch_size"], "temporal_patch_size": v["temporal_patch_size"],
            "spatial_merge_size": v["spatial_merge_size"], "out_hidden_size": t["hidden_size"],
            "num_position_embeddings": v["num_position_embeddings"],
            "deepstack_visual_indexes": v["deepstack_indexes"], "hidden_act": "gelu_pytorch_tanh",
        },
        text_config={
            "vocab_size": t["vocab_size"], "hidden_size": t["hidden_size"],
            "intermediate_size": t["ffn_hidden_size"], "num_hidden_layers": t["num_layers"],
            "num_attention_heads": t["num_attention_heads"],
            "num_key_value_heads": t["num_query_groups"], "head_dim": t["kv_channels"],
            "rms_norm_eps": t["norm_eps"], "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": t["rotary_base"],
                                "mrope_section": t["mrope_section"], "mrope_interleaved": True},
        },
        image_token_id=IMAGE_TOKEN, video_token_id=254, vision_start_token_id=253,
        vision_end_token_id=252, tie_word_embeddings=False,
    )  # fmt: skip


def canonical_from_hf(spec: object, state: Mapping[str, torch.Tensor]) -> dict:
    """Canonical tensors from transformers' state dict through the family's weight rules (a
    tied head's stored copy aside, every tensor used: KeyError naming the others)."""
    from megatron_omnibal.models.families.qwen3_vl.weights import FILE_STYLE, rules
    from megatron_omnibal.models.hf_weights import to_rule_name

    named = {to_rule_name(n, FILE_STYLE): t for n, t in state.items()}
    all_rules = rules(spec)
    extra = set(named) - {h for r in all_rules for h in r.hf} - {"language_model.lm_head.weight"}
    if extra:
        raise KeyError(f"tensors Qwen3-VL does not use: {sorted(extra)[:3]}")
    return {r.canonical: r.to_canonical([named[h] for h in r.hf]) for r in all_rules}


def hf_model(seed: int = 0) -> torch.nn.Module:
    """The tiny model in fp32, every weight perturbed (no norm weight a trivial 1, no bias 0)."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(hf_config()).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _inputs(model: torch.nn.Module, sample: object, video: bool = False) -> dict:
    ids = sample.tokens[None]
    kw: dict = {"input_ids": ids}
    slots = ids == IMAGE_TOKEN
    if video:  # its frames' grids (t = 1 each) are one video of len(grids) temporal patches
        grid = sample.image_grid
        kw.update(input_ids=torch.where(slots, model.config.video_token_id, ids),
                  pixel_values_videos=sample.images,
                  video_grid_thw=torch.tensor([[len(grid), *grid[0, 1:].tolist()]]),
                  mm_token_type_ids=slots.int() * 2)  # fmt: skip
    elif len(sample.image_grid):
        kw.update(pixel_values=sample.images, image_grid_thw=sample.image_grid,
                  mm_token_type_ids=slots.int())  # fmt: skip
    return kw


def video_sample(spec: object, seed: int, frames: int = 2, h: int = 4, w: int = 6) -> object:
    """A video of `frames` temporal patches of h x w patches, as the stages read it: one grid
    (1, h, w) per temporal patch, each frame's placeholders after a timestamp's text tokens
    (transformers splits a video's grid the same way)."""
    from megatron_omnibal.megatron.stream.batch import Sample

    g = torch.Generator().manual_seed(seed)
    units = h * w // 4
    pieces = [torch.randint(1, IMAGE_TOKEN - 10, (3,), generator=g)]
    for _ in range(frames):
        pieces += [torch.randint(1, IMAGE_TOKEN - 10, (2,), generator=g),
                   torch.full((units,), IMAGE_TOKEN)]  # fmt: skip
    pieces.append(torch.randint(1, IMAGE_TOKEN - 10, (5,), generator=g))
    tokens = torch.cat(pieces)
    labels = torch.where(tokens == IMAGE_TOKEN, -100, tokens.roll(-1))
    labels[-1] = -100
    patches = torch.randn(frames * h * w, spec.vit.patch_dim, generator=g)
    return Sample(tokens=tokens, labels=labels, images=patches,
                  image_flags=torch.ones(frames, dtype=torch.int64),
                  image_grid=torch.tensor([[1, h, w]] * frames))  # fmt: skip


def reference_logits(
    model: torch.nn.Module, samples: Sequence[object], videos: Sequence[object] = ()
) -> torch.Tensor:
    """[S, vocab]: each sample's logits (its own 3-D positions), then each video sample's,
    concatenated."""
    with torch.no_grad():
        return torch.cat([model(**_inputs(model, s)).logits[0] for s in samples]
                         + [model(**_inputs(model, v, True)).logits[0] for v in videos])


def reference_loss_and_grads(
    model: torch.nn.Module, batches: Sequence[Sequence[object]]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """(summed token cross-entropy per micro-batch, the gradient of their sum by HF name)."""
    model.zero_grad()
    losses = []
    for batch in batches:
        total = torch.zeros(())
        for s in batch:
            logits = model(**_inputs(model, s)).logits[0]
            total = total + torch.nn.functional.cross_entropy(
                logits, s.labels, ignore_index=-100, reduction="sum"
            )
        total.backward()
        losses.append(float(total.detach()))
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return losses, grads
