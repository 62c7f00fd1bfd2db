#!/usr/bin/env bash
# The device-memory estimate against what `dflash-host bench train` measures, part by part, on one
# GPU: Qwen3-8B with the published drafter (configs/bench/qwen3-8b.toml) at batch 2, 4 and 8, and
# the Qwen3.6-27B-shaped hybrid (configs/bench/qwen3.6-27b.toml) at batch 1 and 2, in bf16 and with
# `[target] compute = "fp8"` (`27b-fp8`: Hopper only), each at 3072 tokens and 512 anchors a
# sequence. A config the estimate says cannot fit is refused (its sentence is printed); the rest
# print estimate, measured and their ratio per part and in total.
#
#   make build
#   scripts/bench/memory_estimate.sh [RESULTS]     # default bench-results/memory, a few minutes
#
# RESULTS gets log.txt (every run's output) and a JSON report per run; the table is printed at the
# end. CASES="8b:4 27b-fp8:1" runs only those.
set -u
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../../bench-results/memory}")
cd "$(dirname "$0")/../.."
source scripts/bench/lib.sh
use_python_torch_libraries
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
CASES=${CASES:-"8b:2 8b:4 8b:8 27b:1 27b:2 27b-fp8:1 27b-fp8:2"}
config() {
    case $1 in
        8b) echo configs/bench/qwen3-8b.toml ;;
        27b | 27b-fp8) echo configs/bench/qwen3.6-27b.toml ;;
    esac
}
for c in $CASES; do
    model=${c%%:*} batch=${c##*:}
    compute=bf16
    [[ $model == *-fp8 ]] && compute=fp8
    # Fewer iterations: memory, not time, is measured.
    part "${model}_b$batch" "$B" bench train --config "$(config "$model")" --set bench.batch_size="$batch" \
        --set bench.warmup=1 --set bench.iters=1 --set target.compute=$compute --json "$RESULTS/${model}_b$batch.json"
done
python3 - "$RESULTS" $CASES << 'PY'
import json, os, sys
results, cases = sys.argv[1], sys.argv[2:]
print(f"{'run':<10} {'part':<34} {'estimate GiB':>12} {'measured GiB':>12} {'ratio':>7}")
for case in cases:
    name = case.replace(":", "_b")
    path = os.path.join(results, f"{name}.json")
    if not os.path.exists(path):
        print(f"{name:<10} (no report: refused or failed, see log.txt)")
        continue
    report = json.load(open(path))
    for row in report.get("memory", []):
        m = row.get("measured_gib")
        ratio = f"{m / row['estimate_gib']:.3f}" if m is not None and row["estimate_gib"] else "-"
        shown = f"{m:.2f}" if m is not None else "-"
        print(f"{name:<10} {row['part']:<34} {row['estimate_gib']:>12.2f} {shown:>12} {ratio:>7}")
PY
grep -h "not enough device memory" "$LOG" | sed 's/^/refused: /'
