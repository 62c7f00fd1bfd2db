#!/usr/bin/env bash
# How far `[target] compute = "fp8"` moves what the drafter learns from, on one Hopper GPU (an
# H100 is enough): `dflash-host bench fp8 --accuracy` runs a target with compute = bf16 and with
# compute = fp8 over the first RECORDS chitchat conversations rendered with SmolLM2's chat template
# (configs/smollm2-chitchat.toml, its replies as published: distill off), and reports the relative
# error ||fp8 - bf16|| / ||bf16|| of every layer's features and of the logits, and the logits' top-1
# agreement. Targets: SmolLM2-135M with its real weights (its hidden size 576 is padded to 1024
# columns for the FP8 GEMM), and random weights at the Qwen3-8B and Qwen3.6-27B bench shapes fed
# the same token ids (random weights lack the outlier channels of trained ones).
#
#   make setup && make build
#   scripts/bench/fp8_accuracy.sh [RESULTS]     # default bench-results/fp8_accuracy; ~2 minutes
#
# For your own target: dflash-host bench fp8 --accuracy --config your.toml --set data.distill=false
# RESULTS gets log.txt and a JSON report per target. PARTS="smollm2 q8" runs only those.
set -u
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../../bench-results/fp8_accuracy}")
cd "$(dirname "$0")/../.."
source scripts/bench/lib.sh
use_python_torch_libraries
CONFIG=${CONFIG:-configs/smollm2-chitchat.toml}
RECORDS=${RECORDS:-16}
run() {
    "$B" bench fp8 --accuracy --config "$CONFIG" --records "$RECORDS" --set data.distill=false \
        --device "${DEVICE:-cuda:0}" --json "$RESULTS/$1.json" "${@:2}"
}
part gpu nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,memory.used --format=csv
part smollm2 run smollm2
part q8 run q8 --shape configs/bench/qwen3-8b.toml
part q27 run q27 --shape configs/bench/qwen3.6-27b.toml
python3 - "$RESULTS" << 'PY'
import json, os, sys
res = sys.argv[1]
print("| target | weights | tokens | features, a layer: min / median / max | logits | top-1 agreement |")
print("|---|---|---:|---|---:|---:|")
for name, label, weights in [("smollm2", "SmolLM2-135M", "real (GGUF Q4_1)"), ("q8", "Qwen3-8B shape", "random"),
                             ("q27", "Qwen3.6-27B shape", "random")]:
    try:
        r = json.load(open(os.path.join(res, name + ".json")))
    except (OSError, ValueError):
        print(f"| {label} | {weights} | failed: see log.txt | | | |")
        continue
    e = sorted(x[1] for x in r["layers"])
    print(f"| {label} | {weights} | {r['tokens']:,} | {e[0]:.4f} / {e[len(e) // 2]:.4f} / {e[-1]:.4f} | "
          f"{r['logits']:.4f} | {100 * r['top1_agreement']:.2f}% |")
PY
grep "^== " "$LOG"
