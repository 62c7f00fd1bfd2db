# Sourced by the device scripts (bench_h200.sh, bench_hybrid_h200.sh, device_nccl.sh,
# device_sliding_window.sh); expects $OUT. Gives `use_torch_libs` and `part`.

LOG=$OUT/log.txt

# libtorch's libraries from the machine's Python torch, on the loader's path (the binaries carried
# there were linked against the same libtorch version).
use_torch_libs() {
    local lib
    lib=$(python3 -c 'import torch, os; print(os.path.dirname(torch.__file__) + "/lib")')
    export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# part NAME SECONDS COMMAND...: run it with a time limit, its output into the log, and say how it
# went; a failing part does not stop the rest. PARTS="a b" runs only the parts named.
part() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    if [ -n "${PARTS:-}" ] && [[ " $PARTS " != *" $name "* ]]; then return; fi
    echo "==== $name: $*" >> "$LOG"
    timeout "$limit" "$@" >> "$LOG" 2>&1
    echo "== $name: exit $? in $((SECONDS - start)) s" | tee -a "$LOG"
}
