# Where split block attention's time goes at the shapes: the same ops as
# kernels/src/block_attention.rs (cuDNN context part, fp32 block part, merge), under the profiler.
import torch
torch.manual_seed(0)
B, H, HKV, D, S, A, BK = 4, 32, 8, 128, 3072, 512, 16
N, G = A * BK, H // HKV
dev, bf, f32 = "cuda", torch.bfloat16, torch.float32
sc = D ** -0.5
q = torch.randn(B, H, N, D, device=dev, dtype=bf)
k = torch.randn(B, HKV, S + N, D, device=dev, dtype=bf)
v = torch.randn(B, HKV, S + N, D, device=dev, dtype=bf)
do = torch.randn(B, H, N, D, device=dev, dtype=bf)
anchors = torch.sort(torch.randperm(S - 1, device=dev)[:A])[0].repeat(B, 1)

def step():
    aq = anchors.repeat_interleave(BK, 1)
    vis = torch.arange(S, device=dev).view(1, 1, S) < aq.unsqueeze(-1)
    bias = torch.full((B, 1, N, S), -3.3895313892515355e38, device=dev, dtype=bf).masked_fill(vis.unsqueeze(1), 0.0)
    rep = lambda t: t[:, :, :S].unsqueeze(2).expand(B, HKV, G, S, D).reshape(B, H, S, D)
    kc, vc = rep(k), rep(v)
    be = bias.expand(B, H, N, S)
    r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kc, vc, be, True, 0.0, False, False, scale=sc)
    oc, lc = r[0], r[1].view(B, H, N)
    qb = q.float().reshape(B, HKV, G, A, BK, D)
    kb = k[:, :, S:].float().reshape(B, HKV, 1, A, BK, D)
    vb = v[:, :, S:].float().reshape(B, HKV, 1, A, BK, D)
    sb = qb @ kb.transpose(-1, -2) * sc
    lcv = lc.view(B, HKV, G, A, BK)
    lse = torch.logaddexp(lcv, torch.logsumexp(sb, -1))
    pb = torch.exp(sb - lse.unsqueeze(-1))
    o = (torch.exp(lcv - lse).unsqueeze(-1) * oc.float().view(B, HKV, G, A, BK, D) + pb @ vb).view(B, H, N, D).to(bf)
    lse = lse.view(B, H, N)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(do, q, kc, vc, o, lse.view(B, H, N, 1), r[6], r[7], be, r[2], r[3], r[4], r[5], 0.0, False, scale=sc)
    sb2 = qb @ kb.transpose(-1, -2) * sc
    p = torch.exp(sb2 - lse.view(B, HKV, G, A, BK, 1))
    dob = do.float().view(B, HKV, G, A, BK, D)
    row = (dob * o.float().view(B, HKV, G, A, BK, D)).sum(-1, keepdim=True)
    dvb = (p.transpose(-1, -2) @ dob).sum(2)
    ds = p * (dob @ vb.transpose(-1, -2) - row) * sc
    dqb = (ds @ kb).view(B, H, N, D)
    dkb = (ds.transpose(-1, -2) @ qb).sum(2)
    return (dq.float() + dqb).to(bf), dk, dv, dkb, dvb

for _ in range(3): step()
torch.cuda.synchronize()
import time; t = time.perf_counter()
for _ in range(5): step()
torch.cuda.synchronize(); print("fwd+bwd ms", (time.perf_counter() - t) / 5 * 1e3)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
