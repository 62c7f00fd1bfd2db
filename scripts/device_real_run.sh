#!/usr/bin/env bash
# A real model trained on the GPU: the embedded default (SmolLM2-135M target, chitchat, seed 0)
# on CUDA in f32 and bf16 (bf16 twice: batches padded to a multiple of 64, the default, and to
# their longest sequence only), 50 steps each. The loss should start near the CPU run's (`make run`:
# 87.08 at step 1; the drafter's initial weights come from the device's RNG, so not exactly) and
# fall as it does there. The device tool carries 64 MiB a call and the model is 98 MB, so it
# travels in two halves over two calls to the same warm machine (it is given back after 30 s idle);
# the binary rides with the first half, so the first call can run the benches as well:
#   here:     scripts/device_real_run.sh pack      # .devcarry/real/{a,b}, ~49 and ~55 MB
#   device 1: scripts/device_real_run.sh stash     # carry .devcarry/real/a and target/device/dflash-host
#   device 2: scripts/device_real_run.sh run       # carry .devcarry/real/b
# `run` also works here, on the CPU, for checking the script: DEVICE=cpu STEPS=2.
set -euo pipefail
source "$(dirname "$0")/device_parts.sh"
STASH=/tmp/dflash-real
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
case ${1:?"pack | stash | run"} in
pack)
    src=${DFLASH_CACHE:-$HOME/.cache/dflash}
    gguf=$(readlink -f "$src/$MODEL")
    rm -rf .devcarry/real
    split_model "$gguf" .devcarry/real
    xz -T2 -6 -c "$(readlink -f "$src/chitchat.json")" > .devcarry/real/b/chitchat.json.xz
    if [ -d "$src/distill" ]; then cp -r "$src/distill" .devcarry/real/b/; fi
    du -sh .devcarry/real/a .devcarry/real/b
    ;;
stash)
    mkdir -p "$STASH" && cp .devcarry/real/a/* "$STASH"/ && cp "${B:-target/device/dflash-host}" "$STASH"/dflash-host
    ls -la "$STASH"
    ;;
run)
    [ -f "$STASH/model.part1" ] || { echo "no $STASH/model.part1: run 'stash' first, on the same machine" >&2; exit 1; }
    export DFLASH_CACHE=$STASH
    join_model "$STASH/model.part1" .devcarry/real/b "$STASH/$MODEL"
    xz -dc .devcarry/real/b/chitchat.json.xz > "$STASH/chitchat.json"
    if [ -d .devcarry/real/b/distill ]; then cp -r .devcarry/real/b/distill "$STASH"/; fi
    if python3 -c 'import torch' 2> /dev/null; then use_torch_libs; fi
    B=${B:-$STASH/dflash-host}
    # dtype and the loader's pad_to_multiple_of ([data] is the config's last section); 1 pads
    # each batch only to its longest sequence: a new shape for cuDNN nearly every batch.
    for variant in "f32 64" "bf16 1" "bf16 64"; do
        read -r dtype pad <<< "$variant"
        config=$STASH/real-$dtype-$pad.toml
        sed "s/^device = \"cpu\"/device = \"${DEVICE:-cuda:0}\"\ndtype = \"$dtype\"/" configs/smollm2-chitchat.toml > "$config"
        echo "pad_to_multiple_of = $pad" >> "$config"
        echo "== $dtype, batches padded to a multiple of $pad"
        "$B" train --config "$config" --exp-dir "$STASH/exp-$dtype-$pad" --steps "${STEPS:-50}" 2>&1 | grep -E "step |loss|tau_hat|acc@1|WARN|rror" || true
    done
    ;;
*)
    echo "usage: $0 pack | stash | run" >&2
    exit 2
    ;;
esac
