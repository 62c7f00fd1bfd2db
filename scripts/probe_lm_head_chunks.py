#!/usr/bin/env python3
"""The loss's LM-head GEMMs at the drafter benchmark's shapes, by chunk size.

The loss forms fp32 logits for a chunk of counted positions at a time (host/src/train/loss.rs):
z = h_c @ W^T (bf16 in, fp32 out) and, for the gradient, dz_c @ W (bf16). The chunk's row count
decides how well those GEMMs fill the GPU. This times both over all 30,720 counted positions of
the benchmark (4 x 512 anchors x 15 labels), Qwen3-8B's head (151,936 x 4096), for several chunk
sizes, with libtorch's cuBLAS (the same library the host links).

    python3 scripts/probe_lm_head_chunks.py [--json out.json]
"""
import argparse
import json

import torch

M, H, V = 30720, 4096, 151936


def timed(fn, iters=5):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    h = torch.randn(M, H, device=dev, dtype=torch.bfloat16)
    w = torch.randn(V, H, device=dev, dtype=torch.bfloat16) * 0.02
    dz_full = torch.randn(6144, V, device=dev, dtype=torch.bfloat16)
    flop = 2 * M * H * V
    rows = []
    print(f"{'chunk rows':>10} {'GiB fp32':>9} {'logits ms':>10} {'TFLOP/s':>8} {'grad ms':>9} {'TFLOP/s':>8} {'both ms':>9}")
    for c in (1536, 2304, 3072, 3456, 3840, 4608, 6144):
        starts = range(0, M, c)

        def logits():
            for s in starts:
                torch.mm(h[s:s + c], w.t(), out_dtype=torch.float32)

        def grad():
            for s in starts:
                n = min(c, M - s)
                torch.mm(dz_full[:n], w)

        t_z, t_g = timed(logits), timed(grad)
        row = {"chunk_rows": c, "logits_s": t_z, "grad_s": t_g, "logits_tflops": flop / t_z / 1e12, "grad_tflops": flop / t_g / 1e12}
        rows.append(row)
        print(f"{c:>10} {c * V * 4 / 2**30:>9.2f} {t_z * 1e3:>10.2f} {row['logits_tflops']:>8.0f} {t_g * 1e3:>9.2f} {row['grad_tflops']:>8.0f} {(t_z + t_g) * 1e3:>9.2f}")
    # The matmul ceiling, as bench train measures it (square bf16).
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    t = timed(lambda: a @ a)
    ceiling = 2 * 8192**3 / t / 1e12
    print(f"square 8192 bf16 matmul: {ceiling:.0f} TFLOP/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "ceiling_tflops": ceiling}, f, indent=1)


if __name__ == "__main__":
    main()
