# Sourced by the device scripts (bench_h200.sh, bench_hybrid_h200.sh, device_nccl.sh,
# device_sliding_window.sh, device_real_run.sh, device_eval.sh, device_default_search.sh,
# device_study.sh). Gives `use_torch_libs`, `part` (logging into $OUT), and for a model too big
# for one call `split_model` / `join_model`, `pack_binaries` / `stash_first_half`.

LOG=${OUT:-.}/log.txt

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

# split_model GGUF DIR [SHIFT]: the model in two parts for two calls to the same warm machine
# (the device tool carries 64 MiB a call): DIR/a/model.part1, SHIFT bytes short of half to leave
# room for what else rides in the first call, and DIR/b/model.part2 with the whole's checksum.
split_model() {
    local gguf=$1 dir=$2 half
    half=$((($(stat -c %s "$gguf") + 1) / 2 - ${3:-0}))
    mkdir -p "$dir/a" "$dir/b"
    head -c "$half" "$gguf" > "$dir/a/model.part1"
    tail -c +"$((half + 1))" "$gguf" > "$dir/b/model.part2"
    sha256sum < "$gguf" | cut -d' ' -f1 > "$dir/b/model.sha256"
}

# join_model PART1 DIR_B OUT: the model whole again at OUT, its checksum checked.
join_model() {
    cat "$1" "$2/model.part2" > "$3"
    [ "$(sha256sum < "$3" | cut -d' ' -f1)" = "$(cat "$2/model.sha256")" ] || { echo "$3: checksum differs" >&2; return 1; }
}

# pack_binaries DIR [OLD_BINARY]: the binary ($B, default target/device/dflash-host), and an older
# one as dflash-host.old, xz-compressed into DIR/a beside the model's first half.
pack_binaries() {
    xz -T2 -6 -c "${B:-target/device/dflash-host}" > "$1/a/dflash-host.xz"
    if [ -n "${2:-}" ]; then xz -T2 -6 -c "$2" > "$1/a/dflash-host.old.xz"; fi
}

# stash_first_half DIR STASH: on the device, the model's first half and the binaries of DIR/a
# into STASH, where the next call (on the same warm machine) joins the model.
stash_first_half() {
    local b
    mkdir -p "$2" && cp "$1/a/model.part1" "$2"/
    for b in "$1"/a/dflash-host*.xz; do xz -dc "$b" > "$2/$(basename "$b" .xz)" && chmod +x "$2/$(basename "$b" .xz)"; done
    ls -la "$2"
}
