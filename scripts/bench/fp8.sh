#!/usr/bin/env bash
# The FP8 linear layers of docs/BENCHMARKS.md on one Hopper GPU (an H100 there): the FP8 CUDA
# tests (the activation quantiser against libtorch's, the layer against the dequantised matmul),
# `dflash-host bench fp8` (bf16 beside FP8 at the linear shapes of Qwen3-8B and Qwen3.6-27B, one
# process), and libtorch's `_scaled_mm` asked which block-scale layouts it takes
# (scripts/bench/fp8_scaled_mm.py; --no-bench: its own timings are PyTorch's, for reference).
#
#   make build && cargo test --release -p kernels --no-run    # the kernels' test binary
#   KERNELS_TEST=target/release/deps/kernels-<hash> scripts/bench/fp8.sh [RESULTS]
#
# RESULTS (default bench-results/fp8) gets log.txt, bench_fp8.json and clocks.csv.
set -u
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../../bench-results/fp8}")
cd "$(dirname "$0")/../.."
source scripts/bench/lib.sh
use_python_torch_libraries
export PYTHONUNBUFFERED=1
sample_clocks

part gpu nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,memory.used --format=csv
if [ -n "${KERNELS_TEST:-}" ]; then
    part fp8_tests "$KERNELS_TEST" --ignored fp8 --test-threads 1 --nocapture
fi
part bench_fp8 "$B" bench fp8 --json "$RESULTS/bench_fp8.json"
part scaled_mm_probe python3 scripts/bench/fp8_scaled_mm.py --no-bench
grep -E "^(FP8|  qwen|qwen|M [0-9]|test |  (ok|NO) |        rel)|panicked|error" "$LOG" | tail -100
