# Sourced by the GPU benchmark scripts in this folder: the Makefile's libtorch environment, the
# results folder, `part` (one benchmark, logged) and `sample_clocks` (the GPU's clock and power
# beside them).

export DFLASH_CACHE=${DFLASH_CACHE:-$HOME/.cache/dflash}
export LIBTORCH=$DFLASH_CACHE/libtorch
export LD_LIBRARY_PATH=$DFLASH_CACHE/libtorch/lib:$DFLASH_CACHE/libtorch-2.11.0/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
B=${B:-target/release/dflash-host}
[ -x "$B" ] || { echo "$B is missing: run \`make build\` first" >&2; exit 1; }
mkdir -p "$RESULTS"
LOG=$RESULTS/log.txt
: > "$LOG"

# part NAME COMMAND...: run it, its output into the log, and say how it went; a failing part does
# not stop the rest. PARTS="a b" runs only the parts named.
part() {
    local name=$1 start=$SECONDS
    shift
    if [ -n "${PARTS:-}" ] && [[ " $PARTS " != *" $name "* ]]; then return; fi
    echo "==== $name: $*" >> "$LOG"
    "$@" >> "$LOG" 2>&1
    echo "== $name: exit $? in $((SECONDS - start)) s" | tee -a "$LOG"
}

# sample_clocks: the SM clock, power draw and memory in use every 500 ms into RESULTS/clocks.csv
# until the script exits (the step is bound by the GPU's power cap, so machines of one kind differ
# by their clock).
sample_clocks() {
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,memory.used --format=csv,noheader -lms 500 \
        > "$RESULTS/clocks.csv" 2>&1 &
    local pid=$!
    trap "kill $pid 2> /dev/null" EXIT
}

# use_python_torch_libraries: put the Python torch's libraries (where `python3` has torch, as on the
# GPU machine) ahead on LD_LIBRARY_PATH, for a test binary or a carried binary whose RUNPATH does
# not reach that libtorch.
use_python_torch_libraries() {
    local torch_dir
    if torch_dir=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))' 2> /dev/null); then
        export LD_LIBRARY_PATH=$torch_dir/lib:$(dirname "$torch_dir")/nvidia/cu13/lib:$LD_LIBRARY_PATH
    fi
}
