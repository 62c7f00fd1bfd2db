#!/usr/bin/env bash
# The c10d communicator on one GPU with NCCL, in one device call (docs/DISTRIBUTED.md):
#   1. training steps through the data-parallel code path (`train --nproc 1`: a launcher's world
#      of 1, NCCL process group, initial weights broadcast, gradients all-reduced, the optimizer's
#      collectives lent), with AdamW and with distributed Muon, on the synthetic target and a
#      small chat file written here (no model to carry), f32;
#   2. `bench allreduce` on the gradients of the 8B-shape drafter (configs/bench/qwen3-8b.toml):
#      the bucketed all-reduce's time per bucket size. A world of 1 measures c10d's and NCCL's
#      fixed cost per call plus a device-local copy, not a link.
# Built here, run there:
#   cargo build --release -p dflash-host && mkdir -p target/device && strip -o target/device/dflash-host target/release/dflash-host
#   cargo build --release --manifest-path tests/plugins/synthetic_target/Cargo.toml --target-dir target && cp target/release/libsynthetic_target.so target/device/
#   device: scripts/device_nccl.sh   (carry target/device; results in $OUT)
# It also runs here on the CPU for checking the script: DEVICE=cpu (Gloo instead of NCCL).
set -u
B=${B:-target/device/dflash-host}
SO=${SO:-target/device/libsynthetic_target.so}
DEVICE=${DEVICE:-cuda:0}
OUT=${OUT:-nccl-out}
mkdir -p "$OUT"
source "$(dirname "$0")/device_parts.sh"
[ "$DEVICE" != cpu ] && use_torch_libs
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}

W=$(mktemp -d)
python3 - "$W/chat.jsonl" <<'PY'
import json, sys
topics = ["rust", "gpus", "tea", "rivers", "chess", "music", "bread", "stars"]
with open(sys.argv[1], "w") as f:
    for i in range(48):
        t = topics[i % len(topics)]
        f.write(json.dumps({"messages": [
            {"role": "user", "content": f"tell me about {t} number {i}"},
            {"role": "assistant", "content": f"{t} is a fine subject and number {i} is a fine number to talk about {t}"},
        ]}) + "\n")
PY
for opt in adamw muon; do
    cat > "$W/$opt.toml" <<EOF
name = "nccl-$opt"
device = "$DEVICE"
dtype = "f32"
[train]
steps = 4
anchors_per_seq = 8
log_every = 1
checkpoint_every = 4
[target]
plugin = "synthetic"
hidden_size = 256
num_hidden_layers = 4
[drafter]
plugin = "dflash"
num_hidden_layers = 2
block_size = 8
num_target_features = 2
mask_token_id = 0
[optimizer]
plugin = "$opt"
lr = 1e-3
[data]
plugin = "chat"
path = "chat.jsonl"
format = "jsonl"
batch_size = 4
max_len = 64
distill = false
EOF
done

part gpu 20 nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv
for opt in adamw muon; do
    part "train_$opt" 180 "$B" --plugin "$SO" train --nproc 1 --config "$W/$opt.toml" --exp-dir "$W/exp-$opt"
    cp "$W/exp-$opt/metrics.jsonl" "$OUT/metrics-$opt.jsonl" 2>/dev/null
done
# (The 8B-shape target is built for its facts: 16 GB in bf16, too much for a CPU check.)
if [ "$DEVICE" != cpu ]; then
    part allreduce 300 "$B" bench allreduce --config configs/bench/qwen3-8b.toml --bucket-mb 16,64,256,1024 --iters 10 --json "$OUT/allreduce.json"
fi
grep "^== " "$LOG"
