"""Training FLOPs of a VLM counted matrix multiply by matrix multiply from its spec: the oracle
for the FLOPs formula (planner.flops) and the MFU of the training log.

A [m, k] x [k, n] product costs 2 m k n. Causal attention over a sample of L tokens counts half
of the L x L score and value products; a training step is a forward and a backward of twice it.
"""

from __future__ import annotations


def matmul(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def forward_flops_by_hand(spec, samples: list[tuple[int, int]]) -> float:
    """Forward FLOPs over samples given as (image tiles, tokens)."""
    v, llm = spec.vit, spec.llm
    patches = (v.image_size // v.patch_size) ** 2
    s = patches + int(v.class_token)
    hv, fv = v.hidden_size, v.ffn_hidden_size
    n, pin, pmid = spec.tokens_per_tile, spec.projector_in, spec.projector_hidden
    h = llm.hidden_size
    kv = llm.num_query_groups * llm.kv_channels
    q = llm.num_attention_heads * llm.kv_channels
    total = 0.0
    for tiles, length in samples:
        for _ in range(tiles):
            total += matmul(patches, 3 * v.patch_size**2, hv)  # the patch convolution
            for _ in range(v.num_layers):
                total += matmul(s, hv, 3 * hv) + matmul(s, hv, hv)  # qkv, attention output
                total += matmul(s, hv, s) + matmul(s, s, hv)  # scores, weighted values
                total += matmul(s, hv, fv) + matmul(s, fv, hv)  # MLP
            total += matmul(n, pin, pmid) + matmul(n, pmid, h)  # projector
        for _ in range(llm.num_layers):
            total += matmul(length, h, q) + 2 * matmul(length, h, kv) + matmul(length, q, h)
            total += (matmul(length, q, length) + matmul(length, length, q)) / 2  # causal
            up = 2 if llm.gated_mlp else 1
            total += up * matmul(length, h, llm.ffn_hidden_size)
            total += matmul(length, llm.ffn_hidden_size, h)
        total += matmul(length, h, llm.vocab_size)  # output head
    return total


def training_flops_by_hand(spec, samples: list[tuple[int, int]]) -> float:
    return 3 * forward_flops_by_hand(spec, samples)
