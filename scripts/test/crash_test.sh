#!/usr/bin/env bash
# The full crash test: kill -9 the trainer at 20 moments (start-up, mid-step, inside checkpoint
# writes, in turn), resuming after each; the finished run must equal an uninterrupted one bit for
# bit. `make test` runs the same test with 5 kills.
#   scripts/test/crash_test.sh [KILLS]
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${LIBTORCH:?run it through `make crash-test`, which sets LIBTORCH and LD_LIBRARY_PATH}"
DFLASH_KILL_POINTS="${1:-20}" cargo test --release -p dflash-host --test reliability kill_9 -- --nocapture 2>&1 \
  | grep -E "kill -9 points survived|test result|panicked|assert"
