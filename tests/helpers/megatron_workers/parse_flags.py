"""Parse flag lists with megatron.training's real argument parser (plus --omnibal*), in a
process of its own because enable_cpu_megatron() patches torch.

Usage: python parse_flags.py CASES.json OUT.json
CASES.json: [[flag, ...], ...]; OUT.json: [{"ok": bool, "error": str, "args": {the parsed
values of the LLM's shape flags in PARSED}}, ...]
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

from megatron_omnibal.megatron.runtime.cpu import enable_cpu_megatron

enable_cpu_megatron()  # on CPU-only torch: before megatron.training imports (Python 3.11)

from megatron.training.arguments import parse_args  # noqa: E402

from megatron_omnibal.megatron.flags.args import add_omnibal_args  # noqa: E402


def parse(flags: list[str]) -> dict:
    """Megatron's parse_args reads sys.argv and exits (status 2) on a flag it does not know."""
    sys.argv = ["pretrain_vlm.py", *flags]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parse_args(extra_args_provider=add_omnibal_args)
    except SystemExit:
        return {"ok": False, "error": err.getvalue()}
    return {"ok": True, "error": "", "args": {k: getattr(args, k, None) for k in PARSED}}


PARSED = ("kv_channels", "qk_layernorm", "add_qkv_bias", "add_bias_linear", "rotary_base",
          "position_embedding_type", "use_rope_scaling", "rope_scaling_factor", "mrope_section",
          "num_virtual_stages_per_pipeline_rank", "num_experts", "moe_ffn_hidden_size",
          "moe_router_topk", "expert_model_parallel_size", "moe_token_dispatcher_type",
          "moe_aux_loss_coeff", "moe_router_pre_softmax")


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps([parse(c) for c in cases]))
