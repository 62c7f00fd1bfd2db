#!/usr/bin/env bash
# The embedded default chosen, and AdamW vs Muon answered, on the H200 (docs/EXPERIMENTS.md):
#   data     the default's replies: its chitchat conversations answered by SmolLM2 in f32
#            (`dflash-host distill`), the reply cache gzipped to $OUT (committed as data/distill/)
#   default  `ab` over the default's shape (data size x steps at an equal CPU budget, depth,
#            anchors, block size) and learning rate, chosen on the validation split
#   apply    the best of those written into configs/smollm2-chitchat.toml (here, on the device)
#   dense    `ab` AdamW vs Muon, the dense drafter, each arm's lr swept, 3 seeds at the chosen lr
#   gdn      the same with the 5-layer Gated DeltaNet drafter (4 GDN : 1 attention)
#   speed    wall-clock speculative decoding of the chosen default's drafter against SmolLM2
#            alone, f32 and bf16, on the test prompts
# The device tool carries 64 MiB a call and the model is 98 MB, so it travels in two halves over
# two calls to the same warm machine (given back after a short idle):
#   here:     scripts/device_study.sh pack            # .devcarry/study/{a,b}
#   device 1: scripts/device_study.sh stash           # carry .devcarry/study/a
#   device 2: scripts/device_study.sh run STAGE...    # carry .devcarry/study/b
# Results come back under $OUT: each A/B's folder without checkpoints, the replies, logs.
set -euo pipefail
source "$(dirname "$0")/device_parts.sh"
STASH=/tmp/dflash-study
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
case ${1:?"pack | stash | run STAGE..."} in
pack)
    src=${DFLASH_CACHE:-$HOME/.cache/dflash}
    rm -rf .devcarry/study
    split_model "$(readlink -f "$src/$MODEL")" .devcarry/study 4000000
    pack_binaries .devcarry/study
    xz -T2 -6 -c "$(readlink -f "$src/chitchat.json")" > .devcarry/study/b/chitchat.json.xz
    du -sh .devcarry/study/a .devcarry/study/b
    ;;
stash)
    stash_first_half .devcarry/study "$STASH"
    ;;
run)
    shift
    export DFLASH_CACHE=$STASH
    [ -f "$STASH/$MODEL" ] || join_model "$STASH/model.part1" .devcarry/study/b "$STASH/$MODEL"
    [ -f "$STASH/chitchat.json" ] || xz -dc .devcarry/study/b/chitchat.json.xz > "$STASH/chitchat.json"
    if python3 -c 'import torch' 2> /dev/null; then use_torch_libs; fi
    out=${OUT:-/tmp/dflash-study-out}
    mkdir -p "$out"
    B=$STASH/dflash-host
    dev=${DEVICE:-cuda:0}
    # An A/B on this device, its folder (minus checkpoints) copied out as one archive.
    ab() {
        local file=$1 name=$2
        timeout "${AB_LIMIT:-540}" "$B" ab --config "$file" --device "$dev" > "$out/ab-$name.log" 2>&1 || { echo "ab $name failed"; tail -20 "$out/ab-$name.log"; }
        tar czf "$out/ab-$name.tgz" --exclude=checkpoints -C experiments "$name" 2> /dev/null || true
        python3 -c "import json,sys; s=json.load(open(sys.argv[1])); [print(a['arm'], a['chosen'], [(p['label'], p['score']) for p in a['points']]) for a in s['arms']]" "experiments/$name/selection.json" || true
        grep -E "tau [0-9]|A/B:" "$out/ab-$name.log" | tail -12 || true
    }
    for stage in "$@"; do
        start=$SECONDS
        case $stage in
        data)
            # The default's records and its validation ones, answered by the target in f32 into
            # a fresh reply cache, shipped gzipped (data/distill/).
            rm -rf "$STASH/distill"
            "$B" distill --config configs/smollm2-chitchat.toml --set "device=\"$dev\"" --set 'dtype="f32"' \
                --set data.max_records=1376 --out "$STASH/distilled.jsonl" > "$out/data.log" 2>&1 || { tail -20 "$out/data.log"; exit 1; }
            grep -E "distill|wrote" "$out/data.log" | tail -4
            for f in "$STASH"/distill/*.jsonl; do gzip -9 -c "$f" > "$out/$(basename "$f").gz"; done
            sha256sum "$STASH/$MODEL" "$out"/*.jsonl.gz
            ;;
        default) ab configs/ab-default.toml default ;;
        apply)
            # The best point over every arm (validation tau-hat) written into the default config,
            # which the two studies start from.
            python3 scripts/apply_default_choice.py experiments/default/selection.json configs/smollm2-chitchat.toml | tee "$out/chosen.txt"
            ;;
        speed)
            run=experiments/default/$(head -1 "$out/chosen.txt")
            "$B" export --exp-dir "$run" --out "$STASH/drafter" --force > /dev/null
            for dtype in f32 bf16; do
                exp=$STASH/speed-$dtype
                rm -rf "$exp" && cp -r "$run" "$exp" && rm -f "$exp"/eval*.json
                sed -i "s/^dtype = .*//; s/^device = .*/device = \"$dev\"\ndtype = \"$dtype\"/" "$exp/config.toml"
                "$B" eval --exp-dir "$exp" --drafter "$STASH/drafter" --limit "${LIMIT:-24}" --max-new-tokens 48 2>&1 | grep -vE "^\s*$|INFO" | tee "$out/speed-$dtype.txt" || true
            done
            ;;
        dense) ab configs/ab-adamw-vs-muon-lr.toml adamw-vs-muon-lr ;;
        gdn) ab configs/ab-gdn-adamw-vs-muon-lr.toml gdn-adamw-vs-muon-lr ;;
        *) echo "unknown stage $stage" >&2 ;;
        esac
        echo "== $stage: $((SECONDS - start)) s"
    done
    ;;
*)
    echo "usage: $0 pack | stash | run STAGE..." >&2
    exit 2
    ;;
esac
