#!/usr/bin/env bash
# The hybrid and MoE target benchmarks in one device call (docs/BENCHMARKS.md): the random
# Qwen3.6-27B-shaped target with the published drafter at 4 x 3072 and 1 x 3072 tokens (target
# forward tok/s and MFU, where its time goes by layer part, drafter step), transformers 5.8.1's
# forward of the same model in the same call (torch fallbacks, then with flash-linear-attention's
# kernels when their wheel is carried), and the Qwen3-30B-A3B-shaped MoE target.
#
# Built here, run there (no Rust on the device):
#   cargo build --release -p dflash-host && mkdir -p target/device \
#     && strip -o target/device/dflash-host target/release/dflash-host
#   # the wheels, once (.whl/ is ignored by git; 16 MB; the pins transformers 5.8.1 checks at import):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     transformers==5.8.1 tokenizers==0.22.2 'regex>=2025.10.22' fla-core==0.6.0
#   device: scripts/bench_hybrid_h200.sh   (carry target/device/dflash-host and .whl; results in $OUT)
# PARTS="gdn_test train_27b_b4 split_27b split_gdn train_27b_b4_loop hf_27b" runs the target
# forward with the fused delta-rule scan and without it, and transformers', in one call.
# Each part has its own time limit and a failing part does not stop the rest; the most important
# run first (the optional transformers-with-FLA and MoE comparisons last), so a call cut short
# still brings them back. About 7-9 minutes in all: run it with the 600 s limit, and if it is cut,
# the rest in a second call: PARTS="train_30b_a3b hf_27b_fla hf_30b_a3b" scripts/bench_hybrid_h200.sh
set -u
B=${B:-target/device/dflash-host}
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
source "$(dirname "$0")/device_parts.sh"
use_torch_libs
export PYTHONUNBUFFERED=1
# The 27B target (54 GB) and the drafter's step share the card: fewer stranded blocks.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}


# transformers 5.8.1 (the machine has another version) into a folder of its own, with the
# tokenizers and regex versions it checks at import; fla-core separately, so the first HF run is
# without it.
if ls .whl/transformers-5.8.1-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/hf581 \
        .whl/transformers-5.8.1-*.whl .whl/tokenizers-*.whl >> "$LOG" 2>&1
    ls .whl/regex-*.whl > /dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --target /tmp/hf581 .whl/regex-*.whl >> "$LOG" 2>&1
    HF_PATH=/tmp/hf581
else
    echo "no .whl/transformers-5.8.1 wheel carried: transformers' run uses the machine's own version" | tee -a "$LOG"
    HF_PATH=
fi
if ls .whl/fla_core-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/fla .whl/fla_core-*.whl >> "$LOG" 2>&1
fi

C27=configs/bench/qwen3.6-27b.toml
sed "s/^batch_size = 4/batch_size = 1/" "$C27" > configs/bench/qwen3.6-27b-b1.toml

part gpu 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu,memory.used --format=csv
# The Gated DeltaNet kernels (conv, WY inverse, scan) against the libtorch ops, when the test binary was carried:
#   cargo test --release -p gated_deltanet --no-run; strip -o target/device/gated_deltanet-tests <it>
if [ -x target/device/gated_deltanet-tests ]; then
    part gdn_test 120 target/device/gated_deltanet-tests --test-threads=1 --nocapture on_cuda
fi
part train_27b_b4 300 "$B" bench train --config "$C27" --json "$OUT/train_27b_b4.json" --trace "$OUT/trace"
part split_27b 60 python3 scripts/trace_summary.py "$OUT/trace/target_forward.trace.json" --top 30
part split_gdn 60 python3 scripts/trace_summary.py "$OUT/trace/target_forward.trace.json" --top 20 --range gdn
# The same with the NVRTC kernels off: the delta rule's scan as the libtorch loop (side by side).
part train_27b_b4_loop 300 env DFLASH_NVRTC=0 "$B" bench train --config "$C27" --json "$OUT/train_27b_b4_loop.json"
part hf_27b 300 env PYTHONPATH="$HF_PATH" python3 scripts/bench_transformers_target.py \
    --config configs/bench/qwen3.6-27b-config.json --batch 4 1 --warmup 1 --iters 3 --json "$OUT/hf_27b.json"
part train_27b_b1 180 "$B" bench train --config configs/bench/qwen3.6-27b-b1.toml --json "$OUT/train_27b_b1.json"
part train_30b_a3b 240 "$B" bench train --config configs/bench/qwen3-30b-a3b.toml --json "$OUT/train_30b_a3b.json"
if [ -d /tmp/fla ]; then
    part hf_27b_fla 240 env PYTHONPATH="/tmp/fla${HF_PATH:+:$HF_PATH}" python3 scripts/bench_transformers_target.py \
        --config configs/bench/qwen3.6-27b-config.json --batch 4 --warmup 1 --iters 3 --json "$OUT/hf_27b_fla.json"
fi
part hf_30b_a3b 240 env PYTHONPATH="$HF_PATH" python3 scripts/bench_transformers_target.py \
    --config configs/bench/qwen3-30b-a3b-config.json --batch 4 --warmup 1 --iters 3 --json "$OUT/hf_30b_a3b.json"
[ -d "$OUT/trace" ] && tar -czf "$OUT/traces.tar.gz" -C "$OUT" trace && rm -r "$OUT/trace"
rm -f configs/bench/qwen3.6-27b-b1.toml
grep "^== " "$LOG"
