#!/usr/bin/env bash
# A first look, on the GPU, at what lifts the embedded default's real acceptance length: the
# default's config with one or two things changed (more self-distilled conversations, more steps,
# block size, anchors, depth, learning rate), each trained on CUDA in f32 and scored by real τ
# (speculative decoding) on 24 validation conversations: `eval_holdout = 112` holds out the test
# conversations and the 48 before them, and `eval --limit 24` takes the first 24 of those, which
# the test set (the last 64) does not contain. The test prompts are not looked at here.
# The device tool carries 64 MiB a call and the model is 98 MB, so it travels in two halves over
# two calls to the same warm machine:
#   here:     scripts/device_default_search.sh pack     # .devcarry/search/{a,b}
#   device 1: scripts/device_default_search.sh stash    # carry .devcarry/search/a
#   device 2: scripts/device_default_search.sh run      # carry .devcarry/search/b
# `run` also works here on the CPU for checking the script: DEVICE=cpu STEPS_SCALE=0.02 LIMIT=2 ONLY=base.
set -euo pipefail
source "$(dirname "$0")/device_parts.sh"
STASH=/tmp/dflash-search
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
case ${1:?"pack | stash | run"} in
pack)
    src=${DFLASH_CACHE:-$HOME/.cache/dflash}
    gguf=$(readlink -f "$src/$MODEL")
    rm -rf .devcarry/search
    split_model "$gguf" .devcarry/search 4000000
    pack_binaries .devcarry/search
    xz -T2 -6 -c "$(readlink -f "$src/chitchat.json")" > .devcarry/search/b/chitchat.json.xz
    if [ -d "$src/distill" ]; then cp -r "$src/distill" .devcarry/search/b/; fi
    du -sh .devcarry/search/a .devcarry/search/b
    ;;
stash)
    stash_first_half .devcarry/search "$STASH"
    ;;
run)
    [ -f "$STASH/model.part1" ] || { echo "no $STASH/model.part1: run 'stash' first, on the same machine" >&2; exit 1; }
    export DFLASH_CACHE=$STASH
    join_model "$STASH/model.part1" .devcarry/search/b "$STASH/$MODEL"
    xz -dc .devcarry/search/b/chitchat.json.xz > "$STASH/chitchat.json"
    # No clobbering: a reply cache grown by an earlier call on this machine stays.
    if [ -d .devcarry/search/b/distill ]; then mkdir -p "$STASH/distill" && cp -n .devcarry/search/b/distill/* "$STASH/distill/"; fi
    if python3 -c 'import torch' 2> /dev/null; then use_torch_libs; fi
    out=${OUT:-/tmp/dflash-search-out}
    mkdir -p "$out"
    B=$STASH/dflash-host
    config=$STASH/base.toml
    sed "s/^device = \"cpu\"/device = \"${DEVICE:-cuda:0}\"/; s/^eval_holdout = 64/eval_holdout = 112/" configs/smollm2-chitchat.toml > "$config"
    scale=${STEPS_SCALE:-1}
    # name | --set overrides (steps last)
    while IFS='|' read -r name sets; do
        [ -z "$name" ] && continue
        if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then continue; fi
        args=()
        for s in $sets; do
            if [[ $s == train.steps=* ]]; then s="train.steps=$(python3 -c "print(max(2, round(${s#train.steps=} * $scale)))")"; fi
            args+=(--set "$s")
        done
        exp=$STASH/exp/$name
        start=$SECONDS
        "$B" train --config "$config" --exp-dir "$exp" "${args[@]}" > "$out/$name.train.log" 2>&1 || { echo "$name: train failed"; tail -5 "$out/$name.train.log"; continue; }
        train_s=$((SECONDS - start))
        "$B" eval --exp-dir "$exp" --limit "${LIMIT:-24}" --max-new-tokens 48 > "$out/$name.eval.log" 2>&1 || { echo "$name: eval failed"; tail -5 "$out/$name.eval.log"; continue; }
        cp "$exp/eval.json" "$out/$name.eval.json"
        cp "$exp/summary.json" "$out/$name.summary.json"
        python3 - "$name" "$exp" "$train_s" "$sets" <<'EOF' | tee -a "$out/search.jsonl"
import json, sys
name, exp, train_s, sets = sys.argv[1:]
e = json.load(open(f"{exp}/eval.json"))
s = json.load(open(f"{exp}/summary.json"))
print(json.dumps({"name": name, "sets": sets, "tau": round(e["tau"], 4), "acc": [round(a, 3) for a in e["acceptance_per_position"][:4]],
                  "tau_hat": round(s["last"]["tau_hat"], 4), "loss": round(s["last"]["loss"], 4), "train_s": int(train_s),
                  "tokens": s["tokens"], "lossless": e["lossless"]}))
EOF
    done <<'EOF'
base|
steps600|train.steps=600
data1k|data.max_records=1024 train.steps=600
data3k|data.max_records=3000 train.steps=600
data1k-b4a64|data.max_records=1024 drafter.block_size=4 train.anchors_per_seq=64 train.steps=600
data1k-a64|data.max_records=1024 train.anchors_per_seq=64 train.steps=600
data1k-lr1e-2|data.max_records=1024 optimizer.lr=1e-2 optimizer.adamw.lr=1e-2 train.steps=600
data1k-d2|data.max_records=1024 drafter.num_hidden_layers=2 train.steps=600
data1k-d3|data.max_records=1024 drafter.num_hidden_layers=3 train.steps=600
data3k-d2-1200|data.max_records=3000 drafter.num_hidden_layers=2 train.steps=1200
EOF
    # The replies the runs distilled: the reply cache, for committing a dataset made from it.
    tar czf "$out/distill-cache.tgz" -C "$STASH" distill
    ;;
*)
    echo "usage: $0 pack | stash | run" >&2
    exit 2
    ;;
esac
