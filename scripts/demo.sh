#!/usr/bin/env bash
# `make demo`: what megatron-omnibal does, in a few minutes on a 2-core CPU after set-up.
#   data     a generated InternVL-format dataset: real JPEG/PNG files, conversations whose
#            answers follow from the question and the picture, a BPE tokenizer trained on the
#            fly; `omnibal stats` measures it for the `tiny` model
#   balance  `omnibal balance` of the shipped 70,706 real InternVL lengths over 64
#            data-parallel ranks, beside random batching; per-rank balance PNG
#   train    `omnibal finetune` of a tiny random Hugging Face InternVL (with the dataset's
#            tokenizer) on the generated samples, from a generated config: stats, plan,
#            convert, Megatron training on 2 gloo processes (DP=2), export, compare-hf; the
#            log's start-up summary, the loss and the per-step balance, the report
#   compare  OmniBal (planned split and recompute, balanced batches) against Megatron's layout
#            with random padded batches, PP=2 on the 2 processes, a few steps each (the short
#            mode of bench/bench_megatron.py); pipeline Gantt PNGs of both (`omnibal simulate`)
# Usage: scripts/demo.sh [data|balance|train|compare ...]   (default: all four, in this order)
# Environment: DEMO_OUT (default out/demo), DEMO_SAMPLES (generated samples, 1200), DEMO_STEPS
# (training steps, 40), DEMO_BATCH (training's global batch, 32), DEMO_COMPARE_STEPS (steps per
# compared run, 8; the first is not timed),
# PYTHON (interpreter, default $VENV/bin/python), VENV (virtual environment, default .venv),
# TORCHRUN (starts the training's and the compared runs' ranks, default torchrun of PYTHON; the
# tests give local_ranks, see docs/launch.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-${VENV:-.venv}/bin/python}
OUT=${DEMO_OUT:-out/demo}
SAMPLES=${DEMO_SAMPLES:-1200}
STEPS=${DEMO_STEPS:-40}
BATCH=${DEMO_BATCH:-32}
COMPARE_STEPS=${DEMO_COMPARE_STEPS:-8}
EXAMPLE=examples/data/internvl_subset.npz
# the generated data's system prompt: words its tokenizer knows (one definition, in data/formats/generate.py)
SYSTEM_PROMPT=$("$PY" -c 'from megatron_omnibal.data.formats.generate import SYSTEM_PROMPT; print(SYSTEM_PROMPT)')
export OMP_NUM_THREADS=1 TORCHDYNAMO_DISABLE=1 TOKENIZERS_PARALLELISM=false
SECTIONS=("$@")
[ ${#SECTIONS[@]} -gt 0 ] || SECTIONS=(data balance train compare)
for s in "${SECTIONS[@]}"; do
    case $s in data | balance | train | compare) ;;
    *) echo "demo: unknown section '$s' (data, balance, train, compare)" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT"
START=$(date +%s)

header() { printf '\n== %s (%ds)\n' "$1" $(($(date +%s) - START)); }
run() { # print a command as a user would type it, then run it
    local words=() word
    for word in "$@"; do
        [[ $word =~ [[:space:]] ]] && word="'$word'"
        words+=("$word")
    done
    echo "\$ ${words[*]}" | sed "s#^\$ $PY -m megatron_omnibal.cli#\$ omnibal#"
    "$@"
}
data() {
    header "data: a generated InternVL-format dataset of real images and conversations"
    rm -rf "$OUT/data"
    run "$PY" -m megatron_omnibal.data.formats.generate "$OUT/data" --samples "$SAMPLES" \
        --images $((SAMPLES / 4 + 1))
    echo "e.g. $(head -n 1 "$OUT/data/pictures.jsonl")"
    run "$PY" -m megatron_omnibal.cli stats "$OUT/data/meta.json" --model tiny \
        --tokenizer "$OUT/data/tokenizer.json" --max-tiles 6 --system-prompt "$SYSTEM_PROMPT" \
        --out "$OUT/data/lengths.npz" --workers 2 --no-progress
}

balance() {
    header "balance: 70,706 real InternVL samples over 64 data-parallel ranks"
    echo "(budgets 18 tiles / 6016 tokens per micro-batch; 'random batching' is the usual"
    echo " sampler: fixed-size random micro-batches; max/mean over ranks, 1.0 = no rank waits)"
    run "$PY" -m megatron_omnibal.cli balance "$EXAMPLE" --dp 64 --vit-budget 18 \
        --token-budget 6016 --json "$OUT/balance.json" --png "$OUT/balance.png"
}

train() {
    header "train: omnibal finetune of a tiny HF InternVL on the generated samples (DP=2 on CPU)"
    [ -f "$OUT/data/meta.json" ] || {
        echo "demo: no $OUT/data/meta.json: run the data section first" >&2
        exit 2
    }
    rm -rf "$OUT/model" "$OUT/finetune"
    run "$PY" -m megatron_omnibal.models.tiny_hf "$OUT/model" \
        --tokenizer "$OUT/data/tokenizer.json" 2>/dev/null
    cat >"$OUT/finetune.yaml" <<EOF
model: model                 # a Hugging Face checkpoint directory (paths: from this file)
data: data/meta.json         # the generated InternVL meta file
output: finetune             # receives everything
system_prompt: $SYSTEM_PROMPT
hardware: A100-80G           # what the plan models
gpus_per_node: 2
device: cpu                  # 2 gloo processes instead of 2 GPUs
tp: 1
pp: 1
iters: $STEPS
lr: 5e-3
min_lr: 5e-4
warmup: 5
global_batch: $BATCH
save_interval: $STEPS
log_interval: 5
seed: 1
megatron_args: [--num-workers, "1"]
preflight: false             # the pre-launch check of the plan (omnibal preflight): skipped here
EOF
    echo "\$ cat $OUT/finetune.yaml"
    sed 's/^/  /' "$OUT/finetune.yaml"
    run "$PY" -m megatron_omnibal.cli finetune "$OUT/finetune.yaml" || {
        echo "demo: omnibal finetune failed (logs: $OUT/finetune/logs)" >&2
        exit 1
    }
    echo
    "$PY" scripts/demo_report.py train "$OUT/finetune/logs/train.log" "$OUT/train.json"
    echo "(the answers follow from the question and the picture: the loss falls from"
    echo " ln(123 tokens) = 4.81 as the model learns them)"
}

compare() {
    header "compare: OmniBal vs baseline step time, PP=2 on the 2 CPU processes"
    echo "(a small VLM whose ViT costs about as much as its LLM, as InternViT-6B + InternLM2-20B,"
    echo " on synthetic samples shaped like 3000 real InternVL lengths; the plan comes from"
    echo " \`omnibal profile\` on this CPU; $COMPARE_STEPS steps per run, the first not timed)"
    rm -rf "$OUT/step_time"
    run "$PY" bench/bench_megatron.py --shapes 6+20b --runs +recompute,baseline \
        --steps "$COMPARE_STEPS" --warmup 1 --samples-per-micro-batch 3 --profile-runs 1 \
        --repeats 1 --no-predict --work-dir "$OUT/step_time" --json "$OUT/step_time.json"
    echo
    "$PY" scripts/demo_report.py compare "$OUT/step_time.json"
    local plan="$OUT/step_time/6+20b/plan.json"
    echo
    run "$PY" -m megatron_omnibal.cli simulate --plan "$plan" --png "$OUT/gantt_omnibal.png"
    run "$PY" -m megatron_omnibal.cli simulate --plan "$plan" --baseline same-parallel \
        --png "$OUT/gantt_baseline.png"
}

for s in "${SECTIONS[@]}"; do "$s"; done
header "summary"
"$PY" scripts/demo_report.py summary "$OUT"
echo "took $(($(date +%s) - START)) s; everything is under $OUT"
