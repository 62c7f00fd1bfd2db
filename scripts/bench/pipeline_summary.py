#!/usr/bin/env python3
"""The figures of scripts/bench/pipeline_27b.sh from its results folder: training tokens/s of
the run (exp/metrics.jsonl, the steps after --skip), where a step's time goes (target worker,
drafter, optimizer, the drafter's wait for features), the hidden-state buffer's depth, the GPU memory in use at its peak
(clocks.csv's samples and the metrics lines' NVML reading), the stages alone (stages.json) and
the figure per GPU beside a reference system. Writes summary.json and summary.txt there.

  python3 scripts/bench/pipeline_summary.py bench-results/pipeline --skip 2
"""

import argparse
import csv
import json
import os
import statistics

p = argparse.ArgumentParser()
p.add_argument("results")
p.add_argument("--skip", type=int, default=2, help="warm-up steps left out")
p.add_argument("--gpus", type=int, default=1, help="GPUs the run used")
p.add_argument("--reference-tok-per-s", type=float, default=16000.0,
               help="the reference system's training tokens/s (three target GPUs and one drafter GPU)")
p.add_argument("--reference-gpus", type=int, default=4)
args = p.parse_args()
R = args.results

lines = [json.loads(x) for x in open(os.path.join(R, "exp", "metrics.jsonl")) if x.strip()]
steps = lines[args.skip:]
assert steps, f"{R}/exp/metrics.jsonl: {len(lines)} steps logged, none after the {args.skip} warm-up ones"
# Each line is one step's window (log_every = 1): its tokens over its tok_per_s is its seconds.
before = lines[args.skip - 1] if args.skip else {"tokens": 0, "draft_tokens": 0}
step_s = [(m["tokens"] - prev["tokens"]) / m["tok_per_s"] for prev, m in zip([before] + steps, steps)]
tokens = steps[-1]["tokens"] - before["tokens"]
wall = sum(step_s)
med = lambda k: statistics.median(m[k] for m in steps)  # noqa: E731
mem_metrics = max((max(m["gpu_mem_mb"]) for m in lines if m.get("gpu_mem_mb")), default=None)
mem_samples = None
clocks = os.path.join(R, "clocks.csv")
if os.path.exists(clocks):
    vals = []
    for row in csv.reader(open(clocks)):
        for cell in row:
            cell = cell.strip()
            if cell.endswith("MiB"):
                vals.append(float(cell.split()[0]))
    mem_samples = max(vals, default=None)

s = {
    "steps": len(steps),
    "tokens": tokens,
    "wall_s": wall,
    "tok_per_s": tokens / wall,
    "tok_per_s_per_gpu": tokens / wall / args.gpus,
    "draft_tok_per_s": (steps[-1]["draft_tokens"] - before["draft_tokens"]) / wall,
    "step_s_median": statistics.median(step_s),
    "target_s_median": med("target_s"),
    "drafter_s_median": med("drafter_s"),
    "optim_s_median": med("optim_s"),
    "wait_s_median": med("wait_s"),
    "target_busy_median": statistics.median(sum(m["target_busy"]) for m in steps),
    "drafter_busy_median": med("drafter_busy"),
    # Micro-batches of features waiting in the hidden-state buffer when the drafter took one.
    "buffer_depth_median": med("q_hs"),
    "peak_gpu_mem_gib": max(x for x in [mem_metrics, mem_samples] if x is not None) / 1024
    if (mem_metrics or mem_samples) else None,
    "peak_rss_mb": max(m["peak_rss_mb"] for m in lines),
    "loss_first_last": [lines[0]["loss"], lines[-1]["loss"]],
    "reference_tok_per_s_per_gpu": args.reference_tok_per_s / args.reference_gpus,
}
s["per_gpu_vs_reference"] = s["tok_per_s_per_gpu"] / s["reference_tok_per_s_per_gpu"]
stages = os.path.join(R, "stages.json")
if os.path.exists(stages):
    # `bench train --json` writes the report as one JSON object.
    r = json.load(open(stages))
    s["stage_target_features_s"] = r["target_features"]["step_s"]
    s["stage_drafter_step_s"] = r["drafter_step"]["step_s"]
    s["stage_seq_tokens"] = r["batch_size"] * r["seq_len"]
    # Stages that share one GPU: a sequence costs the target's forward plus the drafter's step.
    s["stage_bound_tok_per_s"] = s["stage_seq_tokens"] / (s["stage_target_features_s"] + s["stage_drafter_step_s"])
    s["of_stage_bound"] = s["tok_per_s"] / s["stage_bound_tok_per_s"]
json.dump(s, open(os.path.join(R, "summary.json"), "w"), indent=1)
text = "\n".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in s.items())
open(os.path.join(R, "summary.txt"), "w").write(text + "\n")
print(text)
