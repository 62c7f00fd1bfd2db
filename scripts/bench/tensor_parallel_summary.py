"""The table of scripts/bench/tensor_parallel.sh: one row a `bench train --json` file (one bench
config at one tensor-parallel size), Markdown on stdout.

    python3 scripts/bench/tensor_parallel_summary.py bench-results/tensor-parallel/*.json
"""

import json
import os
import sys


def gib(v):
    return "-" if v is None else f"{v:.1f}"


def main(paths):
    print("| config | T | target forward (features) | target tok/s | MFU | drafter step | pipeline target tok/s | memory a rank (GiB, most) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in sorted(paths, key=lambda p: (os.path.basename(p).rsplit("-tp", 1)[0], json.load(open(p)).get("tensor_parallel", 1))):
        r = json.load(open(path))
        name = os.path.basename(path).rsplit("-tp", 1)[0]
        t = r.get("tensor_parallel", 1)
        f = r["target_features"]
        ranks = r.get("ranks") or [{"mem_gib": f.get("mem_gib")}]
        mems = [x["mem_gib"] for x in ranks if x.get("mem_gib") is not None]
        print(
            f"| {name} | {t} | {f['step_s']:.3f} s | {f['tok_per_s']:,.0f} | {100 * f['mfu']:.1f}% "
            f"| {r['drafter_step']['step_s']:.3f} s | {r['pipeline_target_tok_per_s']:,.0f} | {gib(max(mems) if mems else None)} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
