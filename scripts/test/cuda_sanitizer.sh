#!/usr/bin/env bash
# compute-sanitizer over the CUDA code: memcheck over a few training steps of the deep Gated
# DeltaNet drafter with Muon at the embedded default's shapes (configs/bench/smollm2-gdn-muon.toml),
# every tensor its own allocation (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so that a read past a tensor's
# end is seen; then racecheck over each fused kernel's own CUDA test.
#
#   make build && cargo test --release -p kernels --no-run    # the kernels' test binary
#   KERNELS_TEST=target/release/deps/kernels-<hash> scripts/test/cuda_sanitizer.sh [RESULTS]
#
# RESULTS (default bench-results/sanitizer) gets one log per check; the script prints each
# check's summary line and exits non-zero when one found an error.
set -u
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../../bench-results/sanitizer}")
cd "$(dirname "$0")/../.."
B=${B:-target/release/dflash-host}
CS=${CS:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
export PYTORCH_NO_CUDA_MEMORY_CACHING=1
mkdir -p "$RESULTS"
failed=0
check() { # name seconds command...
    local name=$1 secs=$2 start=$SECONDS
    shift 2
    timeout "$secs" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - start)) s: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|Internal Sanitizer' "$RESULTS/$name.log" | tail -1)"
    [ "$rc" -eq 0 ] || failed=1
}
check memcheck-gdn-muon 600 "$CS" --tool memcheck --error-exitcode 9 "$B" bench train --config configs/bench/smollm2-gdn-muon.toml
if [ -n "${KERNELS_TEST:-}" ]; then
    for t in cross_entropy_kernels swiglu_kernels rms_norm_kernels norm_rope_kernels adamw_master fused_block_part; do
        check "racecheck-$t" 300 "$CS" --tool racecheck --error-exitcode 9 "$KERNELS_TEST" --ignored "$t" --test-threads 1
    done
fi
exit $failed
