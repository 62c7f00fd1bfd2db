#!/usr/bin/env bash
# Wall-clock speculative decoding on the GPU: the embedded default's drafter (trained by `make
# run`, exported) against SmolLM2-135M's own greedy decoding, batch 1, on the held-out chitchat
# prompts, f32 and bf16, with and without the per-phase timing, and (when an older binary rides
# along as dflash-host.old) the same runs with it, side by side in one call.
#
# The device tool carries 64 MiB a call and the model is 98 MB, so it travels in two halves over
# two calls to the same warm machine (given back after a short idle):
#   here:     scripts/device_eval.sh pack EXP_DIR [OLD_BINARY]   # .devcarry/eval/{a,b}
#   device 1: scripts/device_eval.sh stash                       # carry .devcarry/eval/a
#   device 2: scripts/device_eval.sh run                         # carry .devcarry/eval/b
# `run` also works here on the CPU for checking the script: DEVICE=cpu LIMIT=2 TOKENS=8.
set -euo pipefail
source "$(dirname "$0")/device_parts.sh"
STASH=/tmp/dflash-eval
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
case ${1:?"pack EXP_DIR [OLD_BINARY] | stash | run"} in
pack)
    exp=${2:?"the experiment folder of a make run"}
    src=${DFLASH_CACHE:-$HOME/.cache/dflash}
    gguf=$(readlink -f "$src/$MODEL")
    rm -rf .devcarry/eval && mkdir -p .devcarry/eval/b/exp
    # Not quite halves: the first call also carries the binaries.
    split_model "$gguf" .devcarry/eval 3000000
    pack_binaries .devcarry/eval "${3:-}"
    # The held-out prompts are the last records by id: the tail of the file is enough.
    python3 - "$(readlink -f "$src/chitchat.json")" .devcarry/eval/b/chitchat.json <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
keep = sorted(d)[-160:]
json.dump({k: d[k] for k in keep}, open(sys.argv[2], "w"))
EOF
    xz -T2 -6 .devcarry/eval/b/chitchat.json
    # The drafter as users serve it (z-lab folder, bf16), and the run's config and manifest.
    "${B:-target/device/dflash-host}" export --exp-dir "$exp" --out .devcarry/eval/b/drafter --force
    cp "$exp/config.toml" "$exp/manifest.json" .devcarry/eval/b/exp/
    du -sh .devcarry/eval/a .devcarry/eval/b
    ;;
stash)
    stash_first_half .devcarry/eval "$STASH"
    ;;
run)
    [ -f "$STASH/model.part1" ] || { echo "no $STASH/model.part1: run 'stash' first, on the same machine" >&2; exit 1; }
    export DFLASH_CACHE=$STASH
    join_model "$STASH/model.part1" .devcarry/eval/b "$STASH/$MODEL"
    xz -dc .devcarry/eval/b/chitchat.json.xz > "$STASH/chitchat.json"
    cp -r .devcarry/eval/b/drafter "$STASH"/
    if python3 -c 'import torch' 2> /dev/null; then use_torch_libs; fi
    out=${OUT:-/tmp/dflash-eval-out}
    mkdir -p "$out"
    for dtype in f32 bf16; do
        for bin in dflash-host dflash-host.old; do
            [ -x "$STASH/$bin" ] || continue
            for split in "" --time-split; do
                exp=$STASH/exp-$dtype-$bin${split:+-split}
                rm -rf "$exp" && cp -r .devcarry/eval/b/exp "$exp"
                sed -i "s/^device = \"cpu\"/device = \"${DEVICE:-cuda:0}\"\ndtype = \"$dtype\"/" "$exp/config.toml"
                if [ "$bin" = dflash-host.old ] && [ -n "$split" ]; then continue; fi
                echo "== $dtype, $bin ${split:-}"
                "$STASH/$bin" eval --exp-dir "$exp" --drafter "$STASH/drafter" --limit "${LIMIT:-24}" \
                    --max-new-tokens "${TOKENS:-48}" $split 2>&1 | grep -vE "^\s*$" || true
                cp "$exp"/eval*.json "$out/eval-$dtype-$bin${split:+-split}.json" 2> /dev/null || true
            done
        done
    done
    ;;
*)
    echo "usage: $0 pack EXP_DIR [OLD_BINARY] | stash | run" >&2
    exit 2
    ;;
esac
