"""What libtorch's `_scaled_mm` does with FP8 block scales on this GPU, and how fast it is.

DeepSeek's recipe (served FP8 checkpoints: `weight_block_size: [128, 128]`): weights e4m3 with a
float32 `weight_scale_inv` per 128x128 block, activations quantised at run time per token per
group of 128 input channels (scale = amax / 448), fp32 accumulation, bf16 out. This script

1. asks `torch._scaled_mm` which scale layouts it takes for that recipe (1x128 activation groups x
   128x128 weight blocks), with a bias or not, K / N not multiples of 128, and prints each answer;
2. checks its result against the fp32 product of the dequantised operands;
3. times, at the linear shapes of Qwen3-8B and Qwen3.6-27B and M = 3072 and 12288 tokens: bf16
   `F.linear`, the block-scaled FP8 GEMM, the row-wise scaled one (per-token x per-output-channel)
   and the per-tensor one, each alone, and PyTorch's composite activation quantiser.

    python3 scripts/bench/fp8_scaled_mm.py [--json OUT.json]

Reference numbers only: the op the product uses is `kernels::fp8` (`dflash-host bench fp8`).
"""

import argparse
import ctypes
import glob
import json
import os

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn

# (model, layer, N = out features, K = in features), as the targets fuse them.
SHAPES = [
    ("qwen3-8b", "attn qkv", 6144, 4096),
    ("qwen3-8b", "attn o", 4096, 4096),
    ("qwen3-8b", "mlp gate_up", 24576, 4096),
    ("qwen3-8b", "mlp down", 4096, 12288),
    ("qwen3.6-27b", "attn q+gate|k|v", 14336, 5120),
    ("qwen3.6-27b", "attn o", 5120, 6144),
    ("qwen3.6-27b", "gdn in_proj qkv|z", 16384, 5120),
    ("qwen3.6-27b", "gdn out", 5120, 6144),
    ("qwen3.6-27b", "mlp gate_up", 34816, 5120),
    ("qwen3.6-27b", "mlp down", 5120, 17408),
]
TOKENS = [3072, 12288]


def cublaslt_version():
    lib_dirs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
    lib_dirs += glob.glob(os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia", "*", "lib"))
    for d in lib_dirs:
        for path in sorted(glob.glob(os.path.join(d, "libcublasLt.so*"))):
            try:
                lib = ctypes.CDLL(path)
                lib.cublasLtGetVersion.restype = ctypes.c_size_t
                return f"{lib.cublasLtGetVersion()} ({path})"
            except OSError:
                continue
    return "not found"


def quantize_act(x):
    """x [M, K] bf16 -> (e4m3 [M, K], scales [M, ceil(K/128)] f32, column-major), as served."""
    m, k = x.shape
    g = (k + 127) // 128
    xp = F.pad(x.float(), (0, g * 128 - k)).view(m, g, 128)
    amax = xp.abs().amax(-1).clamp(min=1e-12)
    scale = amax / E4M3_MAX
    q = (xp / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).view(m, g * 128)[:, :k]
    # outer-dim-major: stride (1, M)
    return q.contiguous(), scale.t().contiguous().t()


def quantize_weight(w):
    """w [N, K] -> (e4m3 [N, K], scale_inv [ceil(N/128), ceil(K/128)] f32, row-major)."""
    n, k = w.shape
    gn, gk = (n + 127) // 128, (k + 127) // 128
    wp = F.pad(w.float(), (0, gk * 128 - k, 0, gn * 128 - n)).view(gn, 128, gk, 128)
    amax = wp.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    s = amax / E4M3_MAX
    q = (wp / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q.view(gn * 128, gk * 128)[:n, :k].contiguous(), s.contiguous()


def dequant_act(q, s):
    m, k = q.shape
    return q.float() * s.repeat_interleave(128, dim=1)[:, :k]


def dequant_weight(q, s):
    n, k = q.shape
    return q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def try_call(what, f):
    try:
        out = f()
        torch.cuda.synchronize()
        print(f"  ok    {what}")
        return out
    except Exception as e:  # noqa: BLE001 - the point is to print what libtorch says
        msg = str(e).strip().splitlines()
        print(f"  NO    {what}: {msg[0][:300] if msg else type(e).__name__}")
        return None


def probe(dev):
    print("\n== which scale layouts _scaled_mm takes (a = x_fp8 [M, K], b = w_fp8.t() [K, N])")
    results = {}
    # K/128 a multiple of 4 or not; M and N off the 128 grid (M odd); K off it with K/128 rounded
    # up to a multiple of 4.
    shapes = [(256, 512, 1024), (200, 384, 640), (256, 400, 1040), (3072, 4096, 4096), (201, 512, 1024),
              (256, 400, 1024), (256, 512, 1008)]
    for m, n, k in shapes:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
        xq, xs = quantize_act(x)
        wq, ws = quantize_weight(w)
        ref = dequant_act(xq, xs) @ dequant_weight(wq, ws).t()
        print(f"M {m} N {n} K {k}: scale_a {tuple(xs.shape)} stride {xs.stride()}, "
              f"scale_inv {tuple(ws.shape)} stride {ws.stride()}")
        kb = (k + 127) // 128
        # 128x128 blocks: libtorch may want the row stride of the [N/128, K/128] scales padded to 4.
        kb4 = (kb + 3) // 4 * 4
        ws_pad = torch.zeros(ws.shape[0], kb4, device=dev)[:, :kb]
        ws_pad.copy_(ws)
        cases = {
            "block: scale_b = scale_inv.t()": lambda: torch._scaled_mm(
                xq, wq.t(), xs, ws.t(), out_dtype=torch.bfloat16),
            "block: scale_inv padded to 4 columns, .t()": lambda: torch._scaled_mm(
                xq, wq.t(), xs, ws_pad.t(), out_dtype=torch.bfloat16),
            "block, fast accum": lambda: torch._scaled_mm(
                xq, wq.t(), xs, ws_pad.t(), out_dtype=torch.bfloat16, use_fast_accum=True),
            "block + bias": lambda: torch._scaled_mm(
                xq, wq.t(), xs, ws_pad.t(), bias=bias, out_dtype=torch.bfloat16),
            "block: scale_a row-major": lambda: torch._scaled_mm(
                xq, wq.t(), xs.contiguous(), ws_pad.t(), out_dtype=torch.bfloat16),
            "block: f32 out": lambda: torch._scaled_mm(
                xq, wq.t(), xs, ws_pad.t(), out_dtype=torch.float32),
        }
        for name, f in cases.items():
            out = try_call(name, f)
            if out is not None:
                want = ref + (bias.float() if "bias" in name else 0)
                err = rel(out, want)
                print(f"        rel error vs fp32 product of the dequantised operands: {err:.2e}")
                results[f"{m}x{n}x{k} {name}"] = err
            else:
                results[f"{m}x{n}x{k} {name}"] = None
    return results


def bench_ms(f):
    import triton.testing

    return triton.testing.do_bench(f, warmup=25, rep=150, return_mode="median")


def bench(dev):
    print("\n== speed (median ms; TFLOP/s = 2 M N K / t)")
    rows = []
    header = f"{'model':12} {'layer':18} {'M':>6} {'N':>6} {'K':>6} | {'bf16':>6} {'block':>6} {'row':>6} {'tensor':>6} | " \
             f"{'blk/bf16':>8} {'row/bf16':>8} | {'quant ms':>8}"
    print(header)
    for model, layer, n, k in SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_weight(w)
        kb = (k + 127) // 128
        ws_pad = torch.zeros(ws.shape[0], (kb + 3) // 4 * 4, device=dev)[:, :kb]
        ws_pad.copy_(ws)
        # row-wise: weights re-quantised per output channel
        wr_s = (w.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / E4M3_MAX)
        wr = (w.float() / wr_s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
        for m in TOKENS:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            xq, xs = quantize_act(x)
            xr_s = (x.float().abs().amax(1, keepdim=True).clamp(min=1e-12) / E4M3_MAX)
            xr = (x.float() / xr_s).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
            one = torch.ones((), device=dev)
            t_bf16 = bench_ms(lambda: F.linear(x, w))
            t_blk = bench_ms(lambda: torch._scaled_mm(xq, wq.t(), xs, ws_pad.t(), out_dtype=torch.bfloat16))
            t_row = bench_ms(lambda: torch._scaled_mm(xr, wr.t(), xr_s, wr_s.t(), out_dtype=torch.bfloat16))
            t_ten = bench_ms(lambda: torch._scaled_mm(xr, wr.t(), one, one, out_dtype=torch.bfloat16))
            t_q = bench_ms(lambda: quantize_act(x))
            fl = 2 * m * n * k / 1e9
            r = dict(model=model, layer=layer, m=m, n=n, k=k, bf16_ms=t_bf16, block_ms=t_blk, row_ms=t_row,
                     tensor_ms=t_ten, torch_quant_ms=t_q, bf16_tflops=fl / t_bf16, block_tflops=fl / t_blk,
                     row_tflops=fl / t_row, tensor_tflops=fl / t_ten)
            rows.append(r)
            print(f"{model:12} {layer:18} {m:6} {n:6} {k:6} | {fl / t_bf16:6.0f} {fl / t_blk:6.0f} {fl / t_row:6.0f} "
                  f"{fl / t_ten:6.0f} | {t_bf16 / t_blk:8.2f} {t_bf16 / t_row:8.2f} | {t_q:8.3f}")
        del w, wq, ws, wr
    # Whole-layer totals: time-weighted ratio over each model's linears (the MLP and projection
    # share of a target layer), at each M.
    for model in dict.fromkeys(s[0] for s in SHAPES):
        for m in TOKENS:
            sel = [r for r in rows if r["model"] == model and r["m"] == m]
            b = sum(r["bf16_ms"] for r in sel)
            k = sum(r["block_ms"] for r in sel)
            print(f"{model} M {m}: one of each linear, bf16 {b:.3f} ms, block-scaled FP8 {k:.3f} ms, ratio {b / k:.2f}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
          f"cuBLASLt {cublaslt_version()}")
    torch.manual_seed(0)
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "probe": probe(dev)}
    if not args.no_bench:
        out["bench"] = bench(dev)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
