# Which SDPA backend masked DFlash attention runs on, and what the context part alone costs.
import torch, time, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
torch.manual_seed(0)
B, H, D, S, A, BK = 4, 32, 128, 3072, 512, 16
N = A * BK
bf = torch.bfloat16
dev = "cuda"
q = torch.randn(B, H, N, D, device=dev, dtype=bf, requires_grad=True)
k = torch.randn(B, H, S + N, D, device=dev, dtype=bf, requires_grad=True)
v = torch.randn(B, H, S + N, D, device=dev, dtype=bf, requires_grad=True)
anchors = torch.sort(torch.randperm(S - 1, device=dev)[:A])[0].repeat(B, 1)
aq = anchors.repeat_interleave(BK, 1)
ctx_vis = torch.arange(S, device=dev).view(1, 1, S) < aq.unsqueeze(-1)
bid = torch.arange(N, device=dev) // BK
mask = torch.cat([ctx_vis, (bid[:, None] == bid[None, :]).expand(B, N, N)], 2).unsqueeze(1)
bias_ctx = torch.zeros(B, 1, N, S, device=dev, dtype=bf).masked_fill(~ctx_vis.unsqueeze(1), -3e38).expand(B, H, N, S)
kc, vc = k[:, :, :S].detach().clone().requires_grad_(), v[:, :, :S].detach().clone().requires_grad_()
do = torch.randn(B, H, N, D, device=dev, dtype=bf)

def t(f, n=5):
    for _ in range(2): f()
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter() - s) / n * 1e3

def run(kk, vv, m, bwd):
    o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=m)
    if bwd: o.backward(do)
for name, be in [("default", None), ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]:
    for part, kk, vv, m in [("full masked", k, v, mask), ("context only", kc, vc, bias_ctx)]:
        try:
            if be is None:
                f, fb = t(lambda: run(kk, vv, m, False)), t(lambda: run(kk, vv, m, True))
            else:
                with sdpa_kernel([be]):
                    f, fb = t(lambda: run(kk, vv, m, False)), t(lambda: run(kk, vv, m, True))
            print(f"{name:10s} {part:13s} fwd {f:7.2f} ms  fwd+bwd {fb:7.2f} ms")
        except Exception as e:
            print(f"{name:10s} {part:13s} failed: {str(e)[:120]}")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    run(k, v, mask, True); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6)[:1500])
