#!/usr/bin/env bash
# Sliding-window drafter layers on the H200, in one device call: the kernels' CUDA tests (the
# fused block part, causal for a sliding layer, and the context part's windowed bias against
# masked attention in fp32), then `bench train` at the Qwen3-8B shapes with full-attention layers
# and with Qwen3.6-27B's layout (4 sliding layers of window 2048 + 1 full; with and without the
# NVRTC kernels). Built here, run there:
#   cargo test --release -p kernels --no-run    # prints the test binary, target/release/deps/kernels-<hash>
#   mkdir -p target/device && strip -o target/device/kernels-tests <that binary>
#   cargo build --release -p dflash-host && strip -o target/device/dflash-host target/release/dflash-host
#   device: scripts/device_sliding_window.sh   (carry target/device; results in $OUT)
# Each part has its own time limit and a failing part does not stop the rest.
set -u
B=${B:-target/device/dflash-host}
OUT=${OUT:-sliding-out}
mkdir -p "$OUT"
source "$(dirname "$0")/device_parts.sh"
use_torch_libs


part gpu 20 nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv
part kernel_tests 180 target/device/kernels-tests --test-threads=1 --nocapture cuda_tests

CONFIG=configs/bench/qwen3-8b.toml
SLIDING=configs/bench/qwen3-8b-sliding.toml
sed 's/^mask_token_id = 151669/&\nlayer_types = ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]\nsliding_window = 2048/' \
    "$CONFIG" > "$SLIDING"
part train_full 240 "$B" bench train --config "$CONFIG" --json "$OUT/train_full.json"
part train_sliding 240 "$B" bench train --config "$SLIDING" --json "$OUT/train_sliding.json"
DFLASH_NVRTC=0 part train_sliding_no_nvrtc 240 "$B" bench train --config "$SLIDING" --json "$OUT/train_sliding_no_nvrtc.json"
rm -f "$SLIDING"
grep "^== " "$LOG"
