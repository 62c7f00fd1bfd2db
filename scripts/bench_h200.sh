#!/usr/bin/env bash
# The drafter-step benchmarks in one device call (docs/BENCHMARKS.md). Built here, run there:
#   cargo build --release -p dflash-host && strip -o target/device/dflash-host target/release/dflash-host
#   device: scripts/bench_h200.sh   (carry target/device/dflash-host; results in $OUT)
# Each part has its own time limit and a failing part does not stop the rest; the most
# important parts run first, so a call cut short still brings them back. The device tool brings
# back 8 files: the parts' output goes to one log, the traces into one archive.
set -u
B=${B:-target/device/dflash-host}
OUT=${OUT:-bench-out}
CONFIG=configs/bench/qwen3-8b.toml
mkdir -p "$OUT"
source "$(dirname "$0")/device_parts.sh"
use_torch_libs


part gpu 20 nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
# The kernels' CUDA tests (kernels/src/cuda_tests.rs), when their test binary was carried:
#   cargo test --release -p kernels --no-run; strip -o target/device/kernels-tests <the binary it names>
if [ -x target/device/kernels-tests ]; then
    part kernel_tests 120 target/device/kernels-tests --test-threads=1 --nocapture cuda_tests
fi
part train 240 "$B" bench train --config "$CONFIG" --json "$OUT/train.json" --trace "$OUT/trace"
part trace_summary 60 python3 scripts/trace_summary.py "$OUT/trace/drafter_step.trace.json" --top 40
part train_b8 240 "$B" bench train --config "$CONFIG" --set bench.batch_size=8 --json "$OUT/train_b8.json"
part attention 120 "$B" bench attention --json "$OUT/attn.json"
part context_probe 120 python3 scripts/probe_context_bias_cost.py --json "$OUT/context_probe.json"
part lm_head_chunks 60 python3 scripts/probe_lm_head_chunks.py --json "$OUT/lm_head_chunks.json"
part flex_attention 240 python3 scripts/bench_torch_drafter.py --attn --attn-alone flex --json "$OUT/flex_attention.json"
DFLASH_NVRTC=0 part train_no_nvrtc 180 "$B" bench train --config "$CONFIG" --json "$OUT/no_nvrtc.json"
part torch 300 python3 scripts/bench_torch_drafter.py --target --attn-alone flex --json "$OUT/torch.json"
if [ "${CHECKPOINT:-0}" = 1 ]; then
    sed "s/^mask_token_id = 151669/&\ncheckpoint_layers = true/" "$CONFIG" > configs/bench/variant.toml
    part checkpoint 180 "$B" bench train --config configs/bench/variant.toml --json "$OUT/checkpoint.json"
fi
[ -d "$OUT/trace" ] && tar -czf "$OUT/traces.tar.gz" -C "$OUT" trace && rm -r "$OUT/trace"
grep "^== " "$LOG"
