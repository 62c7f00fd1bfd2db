# Probe: libtorch's memory-efficient attention called as kernels/src/block_attention.rs calls it.
import sys, torch, torch.nn.functional as F
torch.manual_seed(0)
variant = sys.argv[1]
B, H, D, S, A, BK = (4, 32, 128, 3072, 512, 16) if "big" in variant else (2, 4, 128, 256, 16, 16)
N = A * BK
dev = "cuda"
bf = torch.bfloat16
scale = D ** -0.5
q = torch.randn(B, H, N, D, device=dev, dtype=bf)
kc = torch.randn(B, H, S, D, device=dev, dtype=bf)
vc = torch.randn(B, H, S, D, device=dev, dtype=bf)
anchors = torch.sort(torch.randperm(S - 1, device=dev)[:A])[0].repeat(B, 1)
aq = anchors.repeat_interleave(BK, 1)
vis = torch.arange(S, device=dev).view(1, 1, S) < aq.unsqueeze(-1)
pad = (S + 15) // 16 * 16
bias = torch.full((B, 1, N, pad), -3.3895313892515355e38, device=dev, dtype=bf)[..., :S]
bias = bias.masked_fill(vis.unsqueeze(1), 0.0)
if variant.startswith("contig"):
    bias_e = bias.expand(B, H, N, S).contiguous()
else:
    bias_e = bias.expand(B, H, N, S)
print(variant, "bias", bias_e.shape, bias_e.stride())
o, lse, seed, off = torch.ops.aten._scaled_dot_product_efficient_attention(q, kc, vc, bias_e, True, 0.0, False, scale=scale)
torch.cuda.synchronize()
print("fwd ok", o.shape, o.stride(), lse.shape, lse.stride(), seed, off)
qr, kr, vr = (x.float().requires_grad_() for x in (q, kc, vc))
ref = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=bias_e.float(), scale=scale)
print("fwd err", ((o.float() - ref).abs().max() / ref.abs().max()).item())
do = torch.randn_like(o)
(ref * do.float()).sum().backward()
t = lambda x: x.transpose(1, 2)
if variant.endswith("wrapper"):
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(do, q, kc, vc, bias_e, o, lse, seed, off, 0.0, [True, True, True, False], False, scale=scale)
else:
    lp = torch.zeros(B, H, (N + 31) // 32 * 32, device=dev)
    lp[..., :N] = lse[..., :N]
    if "direct2" in variant:
        go, ot = t(do.contiguous()).contiguous(), t(o.contiguous()).contiguous()
    else:
        go, ot = t(do.contiguous()), t(o.contiguous())
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(go, t(q), t(kc), t(vc), bias_e, ot, None, None, N, S, lp, 0.0, seed, off, 0, False, scale=scale)
    dq, dk, dv = t(dq), t(dk), t(dv)
torch.cuda.synchronize()
for name, x, r in [("dq", dq, qr.grad), ("dk", dk, kr.grad), ("dv", dv, vr.grad)]:
    print(name, ((x.float() - r).abs().max() / r.abs().max()).item())
print("q strides", q.stride(), "o strides", o.stride())
