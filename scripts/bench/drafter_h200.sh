#!/usr/bin/env bash
# The drafter benchmarks of docs/BENCHMARKS.md on one GPU with at least 80 GiB (an H200 there),
# ours beside their PyTorch peers in one run: `bench attention` (one layer's block attention,
# forward + backward, against masked SDPA) and the same attention in compiled flex attention with
# our mask and with SpecForge's block mask; at the Qwen3-8B shapes (configs/bench/qwen3-8b.toml)
# `dflash-host bench train` at batch 4 with a profile and at batch 8, and the same step in PyTorch
# eager with flex attention (SpecForge's attention backend) and with masked SDPA
# (scripts/bench/torch_drafter.py) at batch 4 and with flex at batch 8; then the CUDA tests
# (`make gpu-test`), batch 4 with the NVRTC kernels off, and transformers' target forward.
#
#   make build
#   scripts/bench/drafter_h200.sh [RESULTS]      # default bench-results/drafter, about 15 minutes
#
# The PyTorch rows need a Python with torch 2.11.0 and transformers 5.8.1. RESULTS gets log.txt
# (every part's output), a JSON report per part, the profile's traces and clocks.csv.
# PARTS="train attention" runs only the parts named; a failing part does not stop the rest.
# CHECKPOINT=1 adds batch 4 with `checkpoint_layers = true`.
set -u
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../../bench-results/drafter}")
cd "$(dirname "$0")/../.."
source scripts/bench/lib.sh
CONFIG=configs/bench/qwen3-8b.toml
sample_clocks

part gpu nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv
part attention "$B" bench attention --json "$RESULTS/attention.json"
part torch python3 scripts/bench/torch_drafter.py --attn flex sdpa --attn-alone flex flex_specforge \
    --json "$RESULTS/torch.json"
part train "$B" bench train --config "$CONFIG" --json "$RESULTS/train.json" --trace "$RESULTS/trace"
part train_b8 "$B" bench train --config "$CONFIG" --set bench.batch_size=8 --json "$RESULTS/train_b8.json"
part torch_b8 python3 scripts/bench/torch_drafter.py --batch 8 --attn flex --attn-alone --json "$RESULTS/torch_b8.json"
part trace_summary python3 scripts/bench/trace_summary.py "$RESULTS/trace/drafter_step.trace.json" --top 40
part gpu_test make gpu-test
part train_no_nvrtc env DFLASH_NVRTC=0 "$B" bench train --config "$CONFIG" --json "$RESULTS/train_no_nvrtc.json"
part hf_target python3 scripts/bench/torch_drafter.py --attn --attn-alone --target --json "$RESULTS/hf_target.json"
if [ "${CHECKPOINT:-0}" = 1 ]; then
    part checkpoint "$B" bench train --config "$CONFIG" --set drafter.checkpoint_layers=true \
        --json "$RESULTS/checkpoint.json"
fi
grep "^== " "$LOG"
