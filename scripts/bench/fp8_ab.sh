#!/usr/bin/env bash
# A drafter trained on FP8 features against one trained on bf16 features, on one Hopper GPU (an
# H100 is enough): `dflash-host ab --config configs/ab-fp8-vs-bf16.toml` (the embedded default,
# SmolLM2-135M on chitchat, its target's projections in bf16 or FP8, three seeds each), after each
# arm's target has self-distilled its replies once (the reply cache is keyed by `compute` too, so
# the FP8 arm trains on the FP8 target's own replies). Then a Markdown table: real tau on
# the test prompts per arm and seed, each arm's mean and spread, and the validation tau-hat and
# loss at the last step.
#
#   make setup && make build
#   scripts/bench/fp8_ab.sh [RESULTS]      # default bench-results/fp8_ab; a few minutes
#
# RESULTS gets log.txt, clocks.csv, the A/B's report (report/) and each run's eval.json.
# JOBS (default 3) runs that many trainings at once; PARTS="ab table" skips the distillation.
set -u
RESULTS=$(realpath -m "${1:-$(dirname "$0")/../../bench-results/fp8_ab}")
cd "$(dirname "$0")/../.."
source scripts/bench/lib.sh
use_python_torch_libraries
export PYTHONUNBUFFERED=1
sample_clocks
AB=configs/ab-fp8-vs-bf16.toml
NAME=fp8-vs-bf16

part gpu nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,memory.used --format=csv
# The default's 1,024 training and 64 validation conversations, replied to by each arm's target.
distill_both() {
    for compute in bf16 fp8; do
        "$B" distill --config configs/smollm2-chitchat-f32.toml --device cuda:0 --set 'dtype="bf16"' \
            --set "target.compute=\"$compute\"" --out "$RESULTS/distilled_$compute.jsonl" || return 1
    done
}
part distill distill_both
part ab "$B" ab --config "$AB" --jobs "${JOBS:-3}" --out "$RESULTS/report"
table() {
    for run in experiments/$NAME/*-s*; do
        mkdir -p "$RESULTS/runs/$(basename "$run")"
        cp "$run"/eval.json "$run"/metrics.jsonl "$RESULTS/runs/$(basename "$run")/" 2> /dev/null
    done
    python3 - "$RESULTS/runs" << 'PY'
import json, os, statistics, sys
runs = sys.argv[1]
def tau(run):
    try:
        e = json.load(open(os.path.join(runs, run, "eval.json")))
    except (OSError, ValueError):
        return None
    find = lambda o: o.get("tau") if isinstance(o, dict) and "tau" in o else next(
        (t for v in (o.values() if isinstance(o, dict) else []) for t in [find(v)] if t is not None), None)
    return find(e)
def last_validation(run):
    try:
        lines = [json.loads(l) for l in open(os.path.join(runs, run, "metrics.jsonl")) if l.strip()]
    except OSError:
        return None, None
    v = [l for l in lines if l.get("val_loss") is not None]
    return (v[-1].get("val_tau_hat"), v[-1].get("val_loss")) if v else (None, None)
print("| arm | test tau, seeds 0 / 1 / 2 | mean ± std | validation tau-hat | validation loss |")
print("|---|---|---:|---:|---:|")
for arm in ("bf16", "fp8"):
    taus = [tau(f"{arm}-s{s}") for s in range(3)]
    vals = [last_validation(f"{arm}-s{s}") for s in range(3)]
    got = [t for t in taus if t is not None]
    spread = f"{statistics.mean(got):.3f} ± {statistics.stdev(got):.3f}" if len(got) > 1 else "-"
    fmt = lambda xs: " / ".join("-" if x is None else f"{x:.3f}" for x in xs)
    print(f"| {arm} | {fmt(taus)} | {spread} | {fmt([v[0] for v in vals])} | {fmt([v[1] for v in vals])} |")
PY
}
part table table
cat "$LOG" | grep -A12 "^| arm"
grep "^== " "$LOG"
