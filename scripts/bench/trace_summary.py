#!/usr/bin/env python3
"""Summarise a Kineto trace (dflash-host bench train --trace DIR, or torch.profiler's
export_chrome_trace): GPU time by named range, by the aten op that launched each kernel, and by
kernel, plus the GPU's idle time inside the traced window.

    python3 scripts/bench/trace_summary.py DIR/drafter_step.trace.json [--top 25] [--range "backward / layer 2"]

--range keeps only the kernels launched inside named ranges whose path contains the text.
"""
import argparse
import bisect
import collections
import json
import signal

signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # piped into head: stop quietly


def load(path):
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return [e for e in events if e.get("ph") == "X"]


def nesting(intervals):
    """Each interval's innermost enclosing interval (an index, -1 at the top); intervals sorted by
    start and nested, as ranges and ops of one thread are."""
    parent, open_ = [], []
    for i, (start, _, _) in enumerate(intervals):
        while open_ and intervals[open_[-1]][1] < start:
            open_.pop()
        parent.append(open_[-1] if open_ else -1)
        open_.append(i)
    return parent


def enclosing(intervals, starts, parent, t):
    """Names of the intervals that contain t, outermost first: the last one starting before t,
    then up its parents (an earlier sibling ended before it began)."""
    out = []
    i = bisect.bisect_right(starts, t) - 1
    while i >= 0:
        if intervals[i][1] >= t:
            out.append(intervals[i][2])
        i = parent[i]
    return out[::-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--range", default=None, help="only kernels whose range path contains this")
    args = ap.parse_args()
    events = load(args.trace)
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = collections.defaultdict(list)  # thread -> [(start, end, name)]
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for v in ops.values():
        v.sort()
    op_starts = {t: [s for s, _, _ in v] for t, v in ops.items()}
    op_parents = {t: nesting(v) for t, v in ops.items()}
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "user_annotation")
    range_starts = [s for s, _, _ in ranges]
    range_parents = nesting(ranges)

    total = sum(k["dur"] for k in kernels)
    if not kernels:
        print("no GPU kernels in the trace")
        return
    t0 = min(k["ts"] for k in kernels)
    t1 = max(k["ts"] + k["dur"] for k in kernels)
    by_range, by_op, by_kernel = collections.Counter(), collections.Counter(), collections.Counter()
    count = collections.Counter()
    for k in kernels:
        launch = launches.get(k.get("args", {}).get("correlation"))
        where, op = "(outside ranges)", "(no op)"
        if launch is not None:
            names = enclosing(ranges, range_starts, range_parents, launch["ts"])
            if names:
                where = " / ".join(names)
            tid = launch["tid"]
            outer = enclosing(ops.get(tid, []), op_starts.get(tid, []), op_parents.get(tid, []), launch["ts"])
            if outer:
                # The op the model code called (outermost), and the one that launched (innermost).
                op = outer[0] if len(outer) == 1 else f"{outer[0]} > {outer[-1]}"
        if args.range is not None and args.range not in where:
            continue
        by_range[where] += k["dur"]
        by_op[op] += k["dur"]
        by_kernel[k["name"][:110]] += k["dur"]
        count[k["name"][:110]] += 1

    print(f"{args.trace}: {len(kernels)} GPU activities, {total / 1e3:.1f} ms busy in a {(t1 - t0) / 1e3:.1f} ms window "
          f"({100 * total / (t1 - t0):.1f}% busy)")
    for title, counter in (("named range", by_range), ("aten op (called > launching)", by_op), ("kernel", by_kernel)):
        print(f"\n| {title} | ms | % |\n| --- | --- | --- |")
        for name, us in counter.most_common(args.top):
            extra = f" (x{count[name]})" if counter is by_kernel else ""
            print(f"| {name}{extra} | {us / 1e3:.2f} | {100 * us / total:.1f} |")


if __name__ == "__main__":
    main()
