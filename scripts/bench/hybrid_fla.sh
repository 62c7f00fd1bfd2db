#!/usr/bin/env bash
# The Qwen3.6-27B-shaped hybrid target's forward beside transformers with flash-linear-attention's
# kernels, on one GPU of 80 GB (an H100 is enough): the Gated DeltaNet kernels' CUDA tests, then in
# one call, at 1 x 3072 tokens (BATCHES="1 2" for more):
# - `dflash-host bench train` on the random target (configs/bench/qwen3.6-27b.toml, the drafter cut
#   to one layer to leave the card to the target), with a profile of the target forward split by
#   layer part and, inside the Gated DeltaNet layers, by kernel;
# - the same with the target plugin of another build, where PREVIOUS names its library (its
#   libtarget_hf.so, which replaces the built-in: an A/B of a change to the target);
# - transformers' forward of the same model (scripts/bench/transformers_target.py) with
#   flash-linear-attention's kernels;
# then a table: tok/s and our full forward against each peer.
#
#   make build
#   pip install fla-core==0.6.0                 # where it is missing (it needs only einops besides torch)
#   scripts/bench/hybrid_fla.sh [RESULTS]       # default bench-results/hybrid_fla, ~5 minutes
#
# GDN_TEST names the gated_deltanet test binary (`cargo test --release -p gated_deltanet --no-run`
# prints it) on a machine without cargo. RESULTS gets log.txt, a JSON report per run, the trace
# and clocks.csv.
set -u
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../../bench-results/hybrid_fla}")
cd "$(dirname "$0")/../.."
source scripts/bench/lib.sh
use_python_torch_libraries
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
C27=configs/bench/qwen3.6-27b.toml
sample_clocks

part gpu nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,memory.used --format=csv
if [ -n "${GDN_TEST:-}" ]; then
    part gdn_test "$GDN_TEST" --ignored cuda --test-threads 1 --nocapture
else
    part gdn_test cargo test --release -p gated_deltanet -- --ignored cuda --test-threads=1 --nocapture
fi
BATCHES=${BATCHES:-1}
for b in $BATCHES; do
    set_b="--set bench.batch_size=$b --set bench.seq_len=3072 --set bench.warmup=1 --set bench.iters=3 --set drafter.num_hidden_layers=1"
    trace=()
    [ "$b" = "${BATCHES%% *}" ] && trace=(--trace "$RESULTS/trace")
    part "ours_b$b" "$B" bench train --config "$C27" $set_b --json "$RESULTS/ours_b$b.json" "${trace[@]}"
    part "fla_b$b" python3 scripts/bench/transformers_target.py --warmup 1 --iters 3 \
        --config configs/bench/qwen3.6-27b-config.json --batch "$b" --json "$RESULTS/fla_b$b.json"
    if [ -n "${PREVIOUS:-}" ]; then
        part "previous_b$b" "$B" bench train --plugin "$PREVIOUS" --config "$C27" $set_b \
            --json "$RESULTS/previous_b$b.json"
    fi
done
part split python3 scripts/bench/trace_summary.py "$RESULTS/trace/target_forward.trace.json" --top 30
part split_gdn python3 scripts/bench/trace_summary.py "$RESULTS/trace/target_forward.trace.json" --top 25 --range gdn
grep "^== " "$LOG"

python3 - "$RESULTS" $BATCHES << 'PY'
import json, os, sys
res, batches = sys.argv[1], sys.argv[2:]
def load(name):
    try:
        with open(os.path.join(res, name + ".json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
print("\n| tokens | ours, full forward | previous build | transformers + FLA | ours / previous | ours / FLA |")
print("|---|---:|---:|---:|---:|---:|")
for b in batches:
    ours, prev, fla = load(f"ours_b{b}"), load(f"previous_b{b}"), load(f"fla_b{b}")
    t = lambda r: r["target_full"]["step_s"] if r else None
    f = fla.get(f"forward_b{b}", {}).get("step_s") if fla else None
    cell = lambda s: f"{s:.3f} s ({int(b) * 3072 / s:,.0f} tok/s)" if s else "-"
    ratio = lambda a, c: f"{c / a:.2f}x" if a and c else "-"
    print(f"| {b} x 3072 | {cell(t(ours))} | {cell(t(prev))} | {cell(f)} | {ratio(t(ours), t(prev))} | {ratio(t(ours), f)} |")
    if fla and fla.get("gdn_kernels") != "fla":
        print(f"(transformers ran {fla.get('gdn_kernels')}: flash-linear-attention is not installed)")
PY
