# Probe: split block attention with the context part on cuDNN (forward with its log-sum-exp,
# backward fed the merged output and log-sum-exp), against fp32 masked SDPA.
import torch, torch.nn.functional as F
torch.manual_seed(0)
B, H, D, S, A, BK = 2, 4, 128, 256, 16, 16
N = A * BK
dev, bf = "cuda", torch.bfloat16
sc = D ** -0.5
q = torch.randn(B, H, N, D, device=dev, dtype=bf)
k = torch.randn(B, H, S + N, D, device=dev, dtype=bf)
v = torch.randn(B, H, S + N, D, device=dev, dtype=bf)
do = torch.randn(B, H, N, D, device=dev, dtype=bf)
anchors = torch.sort(torch.randperm(S - 1, device=dev)[:A])[0].repeat(B, 1)
anchors[0, 0] = 0
aq = anchors.repeat_interleave(BK, 1)
vis = torch.arange(S, device=dev).view(1, 1, S) < aq.unsqueeze(-1)
bid = torch.arange(N, device=dev) // BK
mask = torch.cat([vis, (bid[:, None] == bid[None, :]).expand(B, N, N)], 2).unsqueeze(1)
qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask, scale=sc)
(ref * do.float()).sum().backward()
bias = torch.full((B, 1, N, S), -3.3895313892515355e38, device=dev, dtype=bf).masked_fill(vis.unsqueeze(1), 0.0).expand(B, H, N, S)
kc, vc = k[:, :, :S].contiguous(), v[:, :, :S].contiguous()
r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kc, vc, bias, True, 0.0, False, False, scale=sc)
oc, lse_c = r[0], r[1]
print("o", oc.shape, oc.stride(), "lse", lse_c.shape, lse_c.stride(), "rest", [x.shape if torch.is_tensor(x) else x for x in r[2:]])
refl = torch.logsumexp((q.float() @ kc.float().transpose(-1, -2)) * sc + bias.float(), -1)
l2 = lse_c.reshape(B, H, N)
ok = vis.any(-1).unsqueeze(1).expand(B, H, N)
print("lse vs ln", (l2 - refl)[ok].abs().max().item(), " vs log2", (l2 - refl / 0.6931471805599453)[ok].abs().max().item())
noctx = ~ok
lc = l2.masked_fill(noctx, -1e30)
oc = oc.float().masked_fill(noctx.unsqueeze(-1), 0.0)
kb, vb = k[:, :, S:].float().view(B, H, A, BK, D), v[:, :, S:].float().view(B, H, A, BK, D)
qb = q.float().view(B, H, A, BK, D)
sb = qb @ kb.transpose(-1, -2) * sc
lse = torch.logaddexp(lc.view(B, H, A, BK), torch.logsumexp(sb, -1))
pb = torch.exp(sb - lse.unsqueeze(-1))
o = (torch.exp(lc.view(B, H, A, BK) - lse).unsqueeze(-1) * oc.view(B, H, A, BK, D) + pb @ vb).view(B, H, N, D).to(bf)
print("out err", ((o.float() - ref).abs().max() / ref.abs().max()).item())
lse_m = lse.reshape(B, H, N, 1).contiguous() if lse_c.dim() == 4 else lse.reshape(B, H, N)
for layout in ("as-returned", "bmhk-contig"):
    if layout == "as-returned":
        o_in, do_in = o, do
    else:
        o_in, do_in = o.transpose(1, 2).contiguous().transpose(1, 2), do.transpose(1, 2).contiguous().transpose(1, 2)
    dq, dkc, dvc = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(do_in, q, kc, vc, o_in, lse_m, r[6], r[7], bias, r[2], r[3], r[4], r[5], 0.0, False, scale=sc)
    Dm = (do.float() * o.float()).sum(-1, keepdim=True).view(B, H, A, BK, 1)
    dob = do.float().view(B, H, A, BK, D)
    ds = pb * (dob @ vb.transpose(-1, -2) - Dm) * sc
    dq_t = dq.float() + (ds @ kb).view(B, H, N, D)
    dk_t = torch.cat([dkc.float(), (ds.transpose(-1, -2) @ qb).reshape(B, H, N, D)], 2)
    dv_t = torch.cat([dvc.float(), (pb.transpose(-1, -2) @ dob).reshape(B, H, N, D)], 2)
    for n_, x, y in [("dq", dq_t, qr.grad), ("dk", dk_t, kr.grad), ("dv", dv_t, vr.grad)]:
        print(layout, n_, ((x - y).abs().max() / y.abs().max()).item())
