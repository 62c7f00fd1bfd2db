#!/usr/bin/env bash
# Training through the whole pipeline at Qwen3.6-27B's shapes on one 80 GB GPU (an H100): the
# random hybrid target (configs/bench/qwen3.6-27b-config.json) with `[target] compute = "fp8"`
# (its projections' weights one byte each, quantised at load in 128x128 blocks; Hopper only) and
# the published drafter preset (configs/presets/qwen3.6-27b.toml: 5 layers, 4 of them
# sliding-window, sequences of 4096, 8 micro-batches of one sequence a step, AdamW), the target
# worker and the drafter trainer sharing the GPU through the hidden-state buffer, as
# `dflash-host train` runs them. The data are random words of a word-level tokenizer
# (scripts/bench/synthetic_chat.py), so every sequence is 4096 tokens and no self-distillation
# runs. First `bench train` times the two stages alone at one sequence of 4096 (the bound of a
# pipeline whose stages share one GPU is their sum) and measures each part's memory beside the
# estimate; then `train` runs for STEPS logged steps after two warm-up steps and is stopped (no
# checkpoint); scripts/bench/pipeline_summary.py reads its metrics.jsonl.
#
#   make build
#   scripts/bench/pipeline_27b.sh [RESULTS]     # default bench-results/pipeline, about 6 minutes
#
# RESULTS gets log.txt, the stage bench's JSON, the run's folder (exp/), summary.json and
# clocks.csv (with the GPU's memory in use). PARTS="train summary" runs only the parts named.
# COMPUTE (fp8; bf16 needs a GPU with more than 80 GB: the target alone is 54 GB), PRESET,
# TARGET_CONFIG, BENCH_CONFIG, DEVICE and STEPS change what runs (the script's own check on the
# CPU uses a tiny config and COMPUTE=bf16).
set -u
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../../bench-results/pipeline}")
cd "$(dirname "$0")/../.."
source scripts/bench/lib.sh
export PYTHONUNBUFFERED=1
# The 27B target and the drafter's step share the card: fewer stranded blocks.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
PRESET=${PRESET:-configs/presets/qwen3.6-27b.toml}
TARGET_CONFIG=${TARGET_CONFIG:-configs/bench/qwen3.6-27b-config.json}
BENCH_CONFIG=${BENCH_CONFIG:-configs/bench/qwen3.6-27b.toml}
DEVICE=${DEVICE:-cuda:0}
COMPUTE=${COMPUTE:-fp8}
STEPS=${STEPS:-8}
WARMUP_STEPS=2
DATA=$RESULTS/data
sample_clocks

# The preset's shapes, read from it: sequence length, micro-batches a step, the drafter's layers.
preset() { python3 -c "import sys, tomllib; c = tomllib.load(open('$PRESET', 'rb')); print($1)"; }
MAX_LEN=$(preset "c['data']['max_len']")
GRAD_ACCUM=$(preset "c['train']['grad_accum']")
LAYER_TYPES=$(preset "'[' + ', '.join(repr(t).replace(\"'\", '\"') for t in c['drafter']['layer_types']) + ']'")
WINDOW=$(preset "c['drafter']['sliding_window']")

part gpu nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,memory.used --format=csv
# Prompts of 512 words and replies longer than the rest: every sequence is cut at MAX_LEN.
part data python3 scripts/bench/synthetic_chat.py --config "$TARGET_CONFIG" --out "$DATA" \
    --records $(((STEPS + WARMUP_STEPS + 2) * GRAD_ACCUM)) --prompt-words $((MAX_LEN / 8)) --reply-words "$MAX_LEN"
# The two stages alone, at the pipeline's micro-batch and with its drafter.
part stages "$B" bench train --config "$BENCH_CONFIG" --device "$DEVICE" --set bench.batch_size=1 \
    --set bench.seq_len="$MAX_LEN" --set "drafter.layer_types=$LAYER_TYPES" --set drafter.sliding_window="$WINDOW" \
    --set target.compute="$COMPUTE" --json "$RESULTS/stages.json"

# train until STEPS steps after the warm-up are logged, then stop it (a kill: no checkpoint of the
# 1.7B-parameter drafter and its optimizer state is written).
train_steps() {
    rm -rf "$RESULTS/exp"
    "$B" train --config "$PRESET" --exp-dir "$RESULTS/exp" --device "$DEVICE" \
        --set target.path="$DATA/target" --set target.random_init=true --set target.compute="$COMPUTE" \
        --set data.path="$DATA/chat.jsonl" --set data.distill=false \
        --set train.log_every=1 --set train.hidden_cache_mb=0 --set train.checkpoint_every=0 &
    local pid=$! want=$((STEPS + WARMUP_STEPS)) lines=0
    while kill -0 $pid 2> /dev/null; do
        lines=$(cat "$RESULTS/exp/metrics.jsonl" 2> /dev/null | wc -l)
        if [ "$lines" -ge "$want" ]; then
            kill -9 $pid
            wait $pid 2> /dev/null
            echo "stopped after $lines logged steps"
            return 0
        fi
        sleep 1
    done
    wait $pid
    echo "train exited by itself after $lines logged steps"
    return 1
}
part train train_steps
part summary python3 scripts/bench/pipeline_summary.py "$RESULTS" --skip "$WARMUP_STEPS"
cat "$RESULTS/summary.txt" 2> /dev/null
grep "^== " "$LOG"
