# What the staircase bias costs the context part of DFlash attention, and what a kernel that
# skips masked tiles could reach (the "faster than flex" goal). The shapes; the
# context part alone: 16 queries a block against the 3,072 context keys before their anchor.
#
#   python3 scripts/probe_context_bias_cost.py [--json out.json]
#
# Rows: cuDNN with the bias over all keys (as block_attention.rs, before its query ranges),
# cuDNN with the bias over query ranges (as block_attention.rs), the same ranges with each one's
# keys split into a bias-free prefix and a biased staircase tail, cuDNN and flash with no bias
# (dense: twice the useful work, no mask), and compiled flex with the staircase as a block mask.
import argparse, json, time
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

p = argparse.ArgumentParser()
p.add_argument("--json")
p.add_argument("--reps", type=int, default=10)
args = p.parse_args()

torch.manual_seed(0)
B, H, D, S, A, BK = 4, 32, 128, 3072, 512, 16
N = A * BK
dev, bf = "cuda", torch.bfloat16
q = torch.randn(B, H, N, D, device=dev, dtype=bf, requires_grad=True)
k = torch.randn(B, H, S, D, device=dev, dtype=bf, requires_grad=True)
v = torch.randn(B, H, S, D, device=dev, dtype=bf, requires_grad=True)
do = torch.randn(B, H, N, D, device=dev, dtype=bf)
# Anchors as the sampler draws them: distinct, sorted, at least one context key each.
anchors = torch.sort(torch.randperm(S - 1, device=dev)[:A] + 1)[0].repeat(B, 1)
aq = anchors.repeat_interleave(BK, 1)  # [B, N]
visible = torch.arange(S, device=dev).view(1, 1, S) < aq.unsqueeze(-1)
bias = torch.full((B, 1, N, S), -3.3895313892515355e38, device=dev, dtype=bf).masked_fill(visible.unsqueeze(1), 0.0)
useful = visible.float().mean().item()  # fraction of the dense score matrix a query sees
dense_flops = 4 * B * H * N * S * D  # forward: QK^T and PV


def timed(f):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    times = []
    for _ in range(args.reps):
        s = time.perf_counter()
        f()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - s)
    return sorted(times)[len(times) // 2] * 1e3


def both(attend):
    def fwd():
        with torch.no_grad():
            attend()

    def fwd_bwd():
        attend().backward(do)

    return timed(fwd), timed(fwd_bwd)


def sdpa(backend, mask):
    def attend():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


def ranged(n_ranges, prefix_split=False):
    # Whole blocks split into ranges; each range scores only the keys before its last anchor
    # (bounds read once, as block_attention.rs reads them, not inside the timed calls). With
    # `prefix_split` each range's keys split at its first anchor: the prefix every query of the
    # range sees runs without a bias, only the staircase tail with one. The two parts' sum stands
    # in for their log-sum-exp merge (an elementwise pass of the same size).
    per = N // n_ranges
    bounds = []
    for r in range(n_ranges):
        rows = slice(r * per, (r + 1) * per)
        lo = int(aq[:, rows].min().item()) // 64 * 64 if prefix_split else 0
        hi = min(S, (int(aq[:, rows].max().item()) + 63) // 64 * 64)
        bounds.append((rows, lo, hi))

    def attend():
        outs = []
        for rows, lo, hi in bounds:
            qr = q[:, :, rows]
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                m = bias[:, :, rows, lo:hi].expand(B, H, per, hi - lo)
                o = F.scaled_dot_product_attention(qr, k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=m)
                if lo > 0:
                    o = o + F.scaled_dot_product_attention(qr, k[:, :, :lo], v[:, :, :lo])
            outs.append(o)
        return torch.cat(outs, 2)

    return attend


rows = {}
rows["cudnn, bias, all keys"] = both(sdpa(SDPBackend.CUDNN_ATTENTION, bias.expand(B, H, N, S)))
rows["cudnn, bias, 8 query ranges"] = both(ranged(8))
rows["cudnn, 8 ranges, prefix split"] = both(ranged(8, prefix_split=True))
rows["cudnn, 16 ranges, prefix split"] = both(ranged(16, prefix_split=True))
rows["cudnn, no bias (dense)"] = both(sdpa(SDPBackend.CUDNN_ATTENTION, None))
rows["flash, no bias (dense)"] = both(sdpa(SDPBackend.FLASH_ATTENTION, None))
try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)

    def mask_mod(b, h, qi, kj):
        return kj < aq[b, qi]

    bm = create_block_mask(mask_mod, B, None, N, S, device=dev)
    rows["flex, staircase block mask"] = both(lambda: flex(q, k, v, block_mask=bm))
except Exception as e:  # flex needs a working compiler toolchain on the machine
    print(f"flex: {e!r}")

print(f"useful fraction of the dense scores: {useful:.3f}; dense forward {dense_flops / 1e12:.2f} TFLOP")
print(f"{'variant':32} {'fwd ms':>8} {'fwd+bwd ms':>11} {'dense TFLOP/s':>14} {'useful TFLOP/s':>15}")
report = {"useful_fraction": useful, "rows": {}}
for name, (f, fb) in rows.items():
    # fwd+bwd FLOPs: 2.5x the forward's (backward recomputes QK^T and does four GEMMs).
    dense = 3.5 * dense_flops / (fb * 1e-3) / 1e12
    print(f"{name:32} {f:8.2f} {fb:11.2f} {dense:14.0f} {dense * useful:15.0f}")
    report["rows"][name] = {"fwd_ms": f, "fwd_bwd_ms": fb}
dense_fb = rows["cudnn, no bias (dense)"][1]
print(f"bias-free cuDNN scaled to the useful work (a tile-skipping kernel at cuDNN's rate): {dense_fb * useful:.2f} ms")
if args.json:
    json.dump(report, open(args.json, "w"), indent=1)
