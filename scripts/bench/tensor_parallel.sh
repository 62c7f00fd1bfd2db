#!/usr/bin/env bash
# A target replica spread over T GPUs (`[target] tensor_parallel = T`, experts over T ranks for
# MoE targets), T = 1, 2, 4, 8 as far as the machine has GPUs: `bench train --nproc T` at the
# Qwen3.6-27B (hybrid, dense) and Qwen3-30B-A3B (MoE) bench shapes, random bf16 weights. Each
# replica's target forward over NCCL, the drafter step on rank 0, and every rank's device memory
# (the JSON's `ranks`); a table of them at the end (scripts/bench/tensor_parallel_summary.py).
#
#   make build
#   scripts/bench/tensor_parallel.sh [RESULTS]     # default bench-results/tensor-parallel
#
# CONFIGS (bench configs; an MoE one, with `num_experts` in its target config, also splits its
# experts), TPS and DEVICE change what runs; the script's own check on the CPU:
#   CONFIGS=configs/bench/tiny.toml TPS="1 2" DEVICE=cpu scripts/bench/tensor_parallel.sh /tmp/tp
set -u
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../../bench-results/tensor-parallel}")
cd "$(dirname "$0")/../.."
source scripts/bench/lib.sh
CONFIGS=${CONFIGS:-"configs/bench/qwen3.6-27b.toml configs/bench/qwen3-30b-a3b.toml"}
TPS=${TPS:-"1 2 4 8"}
DEVICE=${DEVICE:-cuda:0}
GPUS=$( [ "${DEVICE%%:*}" = cuda ] && nvidia-smi -L 2>/dev/null | wc -l || echo 8)
[ "${DEVICE%%:*}" = cuda ] && sample_clocks

# Whether a bench config's target has routed experts (its target config names a count of them).
is_moe() {
    python3 - "$1" <<'PY'
import json, os, sys, tomllib
cfg = tomllib.load(open(sys.argv[1], "rb"))
path = os.path.join(os.path.dirname(sys.argv[1]), cfg["target"]["path"])
c = json.load(open(path))
c = c.get("text_config", c)
sys.exit(0 if any(c.get(k) for k in ("num_experts", "n_routed_experts", "num_local_experts")) else 1)
PY
}

[ "${DEVICE%%:*}" = cuda ] && part gpu nvidia-smi --query-gpu=name,clocks.sm,power.limit,memory.total --format=csv
for config in $CONFIGS; do
    name=$(basename "$config" .toml)
    for t in $TPS; do
        if [ "$t" -gt "$GPUS" ]; then
            echo "== $name tp$t: skipped ($GPUS GPUs)" | tee -a "$LOG"
            continue
        fi
        split=(--set "target.tensor_parallel=$t")
        is_moe "$config" && split+=(--set "target.expert_parallel=$t")
        nproc=()
        [ "$t" -gt 1 ] && nproc=(--nproc "$t")
        part "$name-tp$t" "$B" bench train "${nproc[@]}" --config "$config" --device "$DEVICE" "${split[@]}" \
            --json "$RESULTS/$name-tp$t.json"
    done
done
python3 scripts/bench/tensor_parallel_summary.py "$RESULTS"/*.json | tee "$RESULTS/summary.md"
