#!/usr/bin/env bash
# The hybrid and MoE target benchmarks of docs/BENCHMARKS.md on one GPU with at least 120 GiB (an
# H200 there): the Gated DeltaNet kernels' CUDA tests; `dflash-host bench train` on the random
# Qwen3.6-27B-shaped target with the published drafter (configs/bench/qwen3.6-27b.toml) at 4 x 3072
# tokens with a profile (target forward tok/s and MFU, where its time goes by layer part, the
# drafter step, the pipeline), the same with the NVRTC kernels off, and at 1 x 3072; transformers'
# forward of the same model (scripts/bench/transformers_target.py) with its torch fallbacks and,
# when flash-linear-attention is installed, with its kernels; and the Qwen3-30B-A3B-shaped MoE
# target (configs/bench/qwen3-30b-a3b.toml), ours and transformers'.
#
#   make build
#   pip install torch==2.11.0 transformers==5.8.1 fla-core==0.6.0   # the transformers rows
#   scripts/bench/hybrid_h200.sh [RESULTS]     # default bench-results/hybrid, about 10 minutes
#
# RESULTS gets log.txt (every part's output), a JSON report per part, the profile's traces and
# clocks.csv. PARTS="train_27b_b4 hf_27b" runs only the parts named; a failing part does not stop
# the rest.
set -u
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../../bench-results/hybrid}")
cd "$(dirname "$0")/../.."
source scripts/bench/lib.sh
export PYTHONUNBUFFERED=1
# The 27B target (54 GB) and the drafter's step share the card: fewer stranded blocks.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
C27=configs/bench/qwen3.6-27b.toml
HF="python3 scripts/bench/transformers_target.py --warmup 1 --iters 3"
sample_clocks

part gpu nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,memory.used --format=csv
part gdn_test cargo test --release -p gated_deltanet -- --ignored cuda --test-threads=1
part train_27b_b4 "$B" bench train --config "$C27" --json "$RESULTS/train_27b_b4.json" --trace "$RESULTS/trace"
part split_27b python3 scripts/bench/trace_summary.py "$RESULTS/trace/target_forward.trace.json" --top 30
part split_gdn python3 scripts/bench/trace_summary.py "$RESULTS/trace/target_forward.trace.json" --top 20 --range gdn
part train_27b_b4_no_nvrtc env DFLASH_NVRTC=0 "$B" bench train --config "$C27" --json "$RESULTS/train_27b_b4_no_nvrtc.json"
part hf_27b $HF --no-fla --config configs/bench/qwen3.6-27b-config.json --batch 4 1 --json "$RESULTS/hf_27b.json"
part train_27b_b1 "$B" bench train --config "$C27" --set bench.batch_size=1 --json "$RESULTS/train_27b_b1.json"
# transformers' forward with flash-linear-attention's kernels, where they are installed.
hf_27b_fla() {
    python3 -c "import fla" 2> /dev/null || { echo "flash-linear-attention is not installed (pip install fla-core==0.6.0)"; return 1; }
    $HF --config configs/bench/qwen3.6-27b-config.json --batch 4 --json "$RESULTS/hf_27b_fla.json"
}
part hf_27b_fla hf_27b_fla
part train_30b_a3b "$B" bench train --config configs/bench/qwen3-30b-a3b.toml --json "$RESULTS/train_30b_a3b.json"
part hf_30b_a3b $HF --config configs/bench/qwen3-30b-a3b-config.json --batch 4 --json "$RESULTS/hf_30b_a3b.json"
grep "^== " "$LOG"
