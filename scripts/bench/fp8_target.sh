#!/usr/bin/env bash
# The target forward with `[target] compute = "fp8"` beside bf16 on one Hopper GPU (an H100 is
# enough): `dflash-host bench train` on random targets at the Qwen3-8B and Qwen3.6-27B bench
# shapes (configs/bench/qwen3-8b.toml, configs/bench/qwen3.6-27b.toml), 1 x 3072 and 4 x 3072
# tokens, each with compute = bf16 and compute = fp8 (its projection weights quantised at load in
# 128x128 blocks, as SGLang's `--quantization fp8` does), one process after the other. Then a
# Markdown table of the target phases: tok/s, MFU (over the bf16 matmul ceiling bench train
# measures) and fp8 / bf16.
#
#   make build
#   scripts/bench/fp8_target.sh [RESULTS]     # default bench-results/fp8_target; ~1 min a run
#
# Only the target phases are the point: the drafter is cut to one layer (same target_layer_ids,
# so the same target work) to leave the card's memory to the target (27B in bf16 is 54 GB), and
# the timing is 1 warm-up + 3 iterations. A run that does not fit (27B bf16 at 4 x 3072 on
# 80 GB) shows as failed in the table; the others go on. PARTS="q8_b1_bf16 q8_b1_fp8" runs only
# the parts named (q8 / q27, b1 / b4, bf16 / fp8). RESULTS gets log.txt, a JSON report per run
# and clocks.csv. Accuracy of FP8 compute (features and logits against the dequantised forward)
# is the CUDA test `cuda_fp8_compute_is_close_to_the_dequantised_forward` (target_hf's
# tests/quantised.rs), not measured here.
set -u
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../../bench-results/fp8_target}")
cd "$(dirname "$0")/../.."
source scripts/bench/lib.sh
use_python_torch_libraries
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
sample_clocks

part gpu nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,memory.used --format=csv
for shape in q8 q27; do
    case $shape in
        q8) cfg=configs/bench/qwen3-8b.toml ;;
        q27) cfg=configs/bench/qwen3.6-27b.toml ;;
    esac
    for b in 1 4; do
        for compute in bf16 fp8; do
            name=${shape}_b${b}_${compute}
            part "$name" "$B" bench train --config "$cfg" --json "$RESULTS/$name.json" \
                --set bench.batch_size=$b --set bench.seq_len=3072 --set bench.warmup=1 --set bench.iters=3 \
                --set drafter.num_hidden_layers=1 --set target.compute=$compute
        done
    done
done
grep -E "^target: |panicked|error|out of memory" "$LOG" | sort | uniq -c | head -20

python3 - "$RESULTS" << 'PY'
import json, os, sys
res = sys.argv[1]
def load(name):
    try:
        with open(os.path.join(res, name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
gpu = next((json.load(open(os.path.join(res, f)))["device"] for f in sorted(os.listdir(res)) if f.endswith(".json")), "?")
print(f"\nTarget forward, bf16 vs FP8 compute ({gpu}; random weights; MFU over the bf16 matmul ceiling)\n")
print("| shape | tokens | phase | bf16 tok/s | bf16 MFU | fp8 tok/s | fp8 MFU | fp8 / bf16 | mem bf16 / fp8 GiB |")
print("|---|---|---|---:|---:|---:|---:|---:|---|")
for shape, label in [("q8", "Qwen3-8B"), ("q27", "Qwen3.6-27B")]:
    for b in (1, 4):
        r = {c: load(f"{shape}_b{b}_{c}") for c in ("bf16", "fp8")}
        for phase, what in [("target_features", "features"), ("target_full", "full + logits")]:
            cells = []
            for c in ("bf16", "fp8"):
                p = r[c] and r[c][phase]
                cells += [f"{p['tok_per_s']:,.0f}", f"{100 * p['mfu']:.1f}%"] if p else ["failed", "-"]
            ratio = (f"{r['fp8'][phase]['tok_per_s'] / r['bf16'][phase]['tok_per_s']:.2f}x"
                     if r["bf16"] and r["fp8"] else "-")
            mem = " / ".join(f"{r[c]['built_mem_gib']:.1f}" if r[c] and r[c].get("built_mem_gib") else "-"
                             for c in ("bf16", "fp8"))
            print(f"| {label} | {b} x 3072 | {what} | {' | '.join(cells)} | {ratio} | {mem} |")
PY
