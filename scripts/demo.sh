#!/usr/bin/env bash
# `make demo`: the whole OmniBal flow on the shipped example data, on this CPU, in < 3 minutes.
#   1. the lengths as a tiny VLM sees them (4 image tokens per tile, text / 4, for a CPU);
#   2. `omnibal balance`: balanced micro-batches of those lengths, with its balance summary;
#   3. `omnibal plan`: budgets, the split of the tiny model over 2 pipeline stages, recompute;
#   4. a real Megatron training with that plan and the balanced data: torchrun, 2 gloo processes,
#      PP=2 (1F1B), synthetic samples shaped like the example lengths; prints the losses.
# Outputs go to $DEMO_OUT (default out/demo). PYTHON overrides the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${DEMO_OUT:-out/demo}
DATA=examples/data/internvl_subset.npz
STEPS=${DEMO_STEPS:-8}
export OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1
mkdir -p "$OUT"
omnibal() { "$PY" -m megatron_omnibal.cli "$@"; }

echo "== 1. lengths of $DATA as the tiny model sees them -> $OUT/lengths.npz"
"$PY" - "$DATA" "$OUT/lengths.npz" <<'EOF'
import sys

from megatron_omnibal.data.lengths import load_lengths, save_lengths
from megatron_omnibal.megatron.data import model_lengths

real = load_lengths(sys.argv[1])
tiny = model_lengths(real, data_tokens_per_tile=256, model_tokens_per_tile=4, text_scale=4)
save_lengths(tiny, sys.argv[2])
print(f"{len(tiny)} samples: {tiny.vit.mean():.2f} tiles, {tiny.tokens.mean():.1f} tokens "
      f"on average (was {real.tokens.mean():.1f} tokens)")
EOF

echo "== 2. omnibal balance (1 data-parallel rank, 4 micro-batches per step)"
omnibal balance "$OUT/lengths.npz" --dp 1 --micro-batches 4 --vit-budget 34 \
    --token-budget 448 --out "$OUT/balance.npz"

echo "== 3. omnibal plan: tiny VLM on 2 GPUs, PP=2, 32 samples per step"
omnibal plan --model tiny --hardware A100-80G --gpus 2 --tp 1 --pp 2 --micro-batches 4 \
    --global-batch 32 --lengths "$OUT/lengths.npz" --out "$OUT/plan.json"

echo "== 4. Megatron training on CPU: torchrun, 2 processes (gloo), PP=2, $STEPS steps"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
    -m megatron_omnibal.pretrain_vlm \
    --omnibal --omnibal-plan "$OUT/plan.json" --omnibal-lengths "$OUT/lengths.npz" \
    --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 4 \
    --train-iters "$STEPS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine \
    --transformer-impl local --seed 1 --log-interval 1 \
    --save "$OUT/checkpoints" --save-interval "$STEPS" --ckpt-format torch \
    >"$OUT/train.log" 2>&1 || {
    tail -n 40 "$OUT/train.log" >&2
    echo "demo: training failed (full log: $OUT/train.log)" >&2
    exit 1
}
grep -oE "iteration +[0-9]+/ *[0-9]+ .*lm loss: [0-9.E+-]+" "$OUT/train.log" |
    sed -E 's/ \| consumed samples:.*lm loss:/ | lm loss:/'
echo "(synthetic samples have random tokens: the loss stays near ln(vocab 512) = 6.24)"
echo "checkpoint: $OUT/checkpoints (iteration $(cat "$OUT/checkpoints/latest_checkpointed_iteration.txt"))"
echo "full log: $OUT/train.log"
