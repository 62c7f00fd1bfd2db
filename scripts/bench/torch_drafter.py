#!/usr/bin/env python3
"""PyTorch eager baseline for `dflash-host bench train`: the same DFlash drafter train
step at the same shapes, random weights, bf16, written plainly in PyTorch.

Step = anchors sampled on the host -> block embeddings -> drafter forward (fc + hidden_norm over
the target features, Qwen3 layers whose attention takes Q from the blocks and K/V from
[context; blocks]) -> DFlash loss (chunked LM head + weighted CE, gradient formed per chunk) ->
backward -> grad-norm clip -> AdamW on fp32 master weights. Attention variants:
  sdpa  scaled_dot_product_attention with a boolean [B, 1, N, S+N] mask (what the Rust drafter runs)
  flex  torch.compile'd flex_attention with the same mask as a block mask
  flex_specforge  (attention alone only) flex_attention with SpecForge's DFlash block mask
        (create_dflash_block_mask: the context up to and including the anchor)
  sdpa_gqa  (attention alone only) enable_gqa with the mask, as the Rust drafter calls it
Also times the attention alone (forward + backward) for each, and, with --target, the HF
Qwen3-8B-shaped target forward (transformers, sdpa).

  python3 scripts/bench/torch_drafter.py --attn sdpa flex --target --json out.json
"""

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=4)
p.add_argument("--seq", type=int, default=3072)
p.add_argument("--anchors", type=int, default=512)
p.add_argument("--block", type=int, default=16)
p.add_argument("--layers", type=int, default=5)
p.add_argument("--target-layers", type=int, nargs="+", default=[1, 9, 17, 25, 33])
p.add_argument("--config", default="configs/bench/qwen3-8b-config.json")
p.add_argument("--attn", nargs="*", default=["sdpa", "flex"], help="variants whose whole step is timed (none: --attn alone)")
p.add_argument("--attn-alone", nargs="*", default=["sdpa", "sdpa_gqa", "flex"], help="variants timed alone")
p.add_argument("--warmup", type=int, default=2)
p.add_argument("--iters", type=int, default=5)
p.add_argument("--chunk-bytes", type=int, default=1 << 30, help="fp32 logits formed at once")
p.add_argument("--target", action="store_true", help="also time the HF target forward")
p.add_argument("--json")
args = p.parse_args()

cfg = json.load(open(args.config))
H, NH, NKV, D = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
FFN, V, EPS, THETA = cfg["intermediate_size"], cfg["vocab_size"], cfg["rms_norm_eps"], cfg["rope_theta"]
B, S, A, BK, L = args.batch, args.seq, args.anchors, args.block, args.layers
NF = len(args.target_layers)
N = A * BK
# The CPU only to try the script at small shapes (--config configs/bench/tiny-config.json).
dev, dt = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16


def sync():
    if dev.type == "cuda":
        torch.cuda.synchronize()

torch.manual_seed(0)


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def ceiling(n=8192, reps=10):
    a, b = torch.randn(n, n, device=dev, dtype=dt), torch.randn(n, n, device=dev, dtype=dt)

    def run():
        for _ in range(reps):
            a @ b

    return 2 * n**3 * reps / timed(run, 1, 3) / 1e12


def rms(x, w):
    # F.rms_norm: one fused kernel on CUDA, as the Rust drafter calls it (torch >= 2.9 on CUDA).
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, EPS)


def rope(pos):
    inv = torch.exp(torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D * -math.log(THETA))
    f = pos.float()[..., None] * inv
    e = torch.cat([f, f], -1)[:, None]
    return e.cos().to(dt), e.sin().to(dt)


def apply_rope(x, cos, sin):
    a, b = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat([-b, a], -1) * sin


def lin(o, i):
    return (torch.randn(o, i, device=dev, dtype=dt) * 0.02).requires_grad_()


def ones(n):
    return torch.ones(n, device=dev, dtype=dt, requires_grad=True)


P = {"fc": lin(H, NF * H), "hidden_norm": ones(H), "norm": ones(H)}
for i in range(L):
    for n, shape in [("q", (NH * D, H)), ("k", (NKV * D, H)), ("v", (NKV * D, H)), ("o", (H, NH * D)),
                     ("gate", (FFN, H)), ("up", (FFN, H)), ("down", (H, FFN))]:
        P[f"{i}.{n}"] = lin(*shape)
    for n, d in [("q_norm", D), ("k_norm", D), ("ln1", H), ("ln2", H)]:
        P[f"{i}.{n}"] = ones(d)
embed = torch.randn(V, H, device=dev, dtype=dt) * 0.02
lm_head = torch.randn(V, H, device=dev, dtype=dt) * 0.02
params = list(P.values())
master = [q.detach().float().clone().requires_grad_() for q in params]
opt = torch.optim.AdamW(master, lr=6e-4, betas=(0.9, 0.999), weight_decay=0.0, fused=True)

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
except Exception as e:  # noqa: BLE001
    flex, flex_err = None, repr(e)


def sdpa_attn(q, k, v, anchors, gqa=False):
    """gqa=False: K/V heads repeated to the query heads first (HF's repeat_kv), so the
    memory-efficient kernel takes the mask; gqa=True: enable_gqa with a mask, as the Rust drafter
    calls it, which CUDA runs on the math path (HF's sdpa_attention.py says the same)."""
    qa = anchors.repeat_interleave(BK, 1)  # [B, N] anchor of each query
    ctx = torch.arange(S, device=dev)[None, None] < qa[..., None]
    blk = torch.arange(N, device=dev) // BK
    same = (blk[:, None] == blk[None]).expand(B, N, N)
    mask = torch.cat([ctx, same], 2)[:, None]
    if gqa:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def flex_mask(anchors, specforge=False):
    """specforge=False: the context strictly before the anchor, as the Rust drafter sees it (the
    anchor's own token is the block's first); True: SpecForge's mask, the anchor's position too."""

    def mask_mod(b, h, qi, ki):
        a = anchors[b, qi // BK]
        in_ctx = (ki < S) & ((ki <= a) if specforge else (ki < a))
        in_blk = (ki >= S) & ((ki - S) // BK == qi // BK)
        return in_ctx | in_blk

    return create_block_mask(mask_mod, B, None, N, S + N, device=dev)


def drafter(target_hidden, block_embeds, anchors, attn):
    ctx = rms(target_hidden @ P["fc"].T, P["hidden_norm"])  # [B, S, H]
    qpos = (anchors[..., None] + torch.arange(BK, device=dev)).reshape(B, N)
    kpos = torch.cat([torch.arange(S, device=dev).expand(B, S), qpos], 1)
    (qc, qs), (kc, ks) = rope(qpos), rope(kpos)
    bm = flex_mask(anchors) if attn == "flex" else None
    x = block_embeds
    for i in range(L):
        g = lambda n: P[f"{i}.{n}"]  # noqa: E731
        xn = rms(x, g("ln1"))
        q = rms((xn @ g("q").T).view(B, N, NH, D), g("q_norm")).transpose(1, 2)
        k = torch.cat([ctx @ g("k").T, xn @ g("k").T], 1).view(B, S + N, NKV, D)
        k = rms(k, g("k_norm")).transpose(1, 2)
        v = torch.cat([ctx @ g("v").T, xn @ g("v").T], 1).view(B, S + N, NKV, D).transpose(1, 2)
        q, k = apply_rope(q, qc, qs), apply_rope(k, kc, ks)
        if attn == "flex":
            o = flex(q, k, v, block_mask=bm, enable_gqa=True)
        else:
            o = sdpa_attn(q, k, v, anchors, gqa=attn == "sdpa_gqa")
        x = x + o.transpose(1, 2).reshape(B, N, NH * D) @ g("o").T
        xn = rms(x, g("ln2"))
        x = x + (F.silu(xn @ g("gate").T) * (xn @ g("up").T)) @ g("down").T
    return rms(x, P["norm"])


class ChunkedCE(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T, t_i), logits formed a chunk at a time; dL/dh formed with them."""

    @staticmethod
    def forward(ctx, h, w, t, weights, chunk):
        loss = torch.zeros((), device=h.device, dtype=torch.float32)
        grads, hits = [], []
        for i in range(0, h.shape[0], chunk):
            # As host/src/loss.rs: fp32 logits out of the GEMM, fp32 log-probabilities, the
            # gradient's softmax - onehot written back in the model dtype (label entries from
            # expm1 in fp32), the weights applied to the [c, H] product.
            z = torch.mm(h[i : i + chunk], w.T, out_dtype=torch.float32)
            tc, wc = t[i : i + chunk, None], weights[i : i + chunk]
            hits.append(z.argmax(-1) == tc[:, 0])
            logp = z.log_softmax(-1)
            del z
            logp_t = logp.gather(1, tc)
            loss -= (logp_t[:, 0] * wc).sum()
            q = torch.exp(logp, out=torch.empty_like(logp, dtype=h.dtype))
            q.scatter_(1, tc, logp_t.expm1().to(q.dtype))
            del logp
            grads.append(((q @ w).float() * wc[:, None]).to(h.dtype))
        ctx.save_for_backward(torch.cat(grads))
        ctx.hits = torch.cat(hits)
        return loss

    @staticmethod
    def backward(ctx, g):
        return ctx.saved_tensors[0] * g.to(ctx.saved_tensors[0].dtype), None, None, None, None


def dflash_loss(block_hidden, input_ids, loss_mask, anchors, gamma=7.0):
    k = torch.arange(BK, device=dev)
    pos = anchors[..., None] + k
    posc = pos.clamp(max=S - 1).view(B, N)
    labels = input_ids.gather(1, posc).view(-1)
    valid = (pos < S) & (loss_mask.gather(1, posc).view(B, A, BK) > 0) & (k > 0)
    wts = (valid.float() * torch.exp(-(k.float() - 1) / gamma)).view(-1)
    idx = valid.view(-1).nonzero()[:, 0]
    wsel = wts[idx] / wts[idx].sum()
    chunk = max(1, args.chunk_bytes // (4 * V))
    h = block_hidden.reshape(-1, H)[idx]
    return ChunkedCE.apply(h, lm_head, labels[idx], wsel, chunk), idx.numel()


def train_step(attn, input_ids, loss_mask, feats):
    anchors = torch.stack([torch.randperm(S - 1)[:A].sort().values for _ in range(B)]).to(dev)
    ids = input_ids.to(dev)
    block_ids = torch.full((B, A, BK), cfg.get("mask_token_id", 151669), dtype=torch.int64)
    block_ids = block_ids.to(dev)
    block_ids[..., 0] = ids.gather(1, anchors)
    emb = F.embedding(block_ids.view(B, N), embed)
    out = drafter(feats, emb, anchors, attn)
    loss, counted = dflash_loss(out, ids, loss_mask.to(dev), anchors)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for m, q in zip(master, params):
        m.grad = q.grad.float()
        q.grad = None
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        for m, q in zip(master, params):
            q.copy_(m)
    return counted


def attention_alone(attn):
    """Forward + backward of one layer's block attention at the step's shape."""
    q = torch.randn(B, NH, N, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, NKV, S + N, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, NKV, S + N, D, device=dev, dtype=dt, requires_grad=True)
    anchors = torch.stack([torch.randperm(S - 1)[:A].sort().values for _ in range(B)]).to(dev)
    do = torch.randn(B, NH, N, D, device=dev, dtype=dt)
    flexed = attn.startswith("flex")
    bm = flex_mask(anchors, specforge=attn == "flex_specforge") if flexed else None

    def fwd():
        if flexed:
            return flex(q, k, v, block_mask=bm, enable_gqa=True)
        return sdpa_attn(q, k, v, anchors, gqa=attn == "sdpa_gqa")

    def fwd_bwd():
        fwd().backward(do)

    keys = (anchors.double().sum() + B * A * BK).item() * BK  # useful keys over all queries
    useful = 4 * NH * D * keys  # QK^T + PV
    f = timed(fwd, 3, 10)
    fb = timed(fwd_bwd, 3, 10)
    return {"fwd_ms": f * 1e3, "fwd_bwd_ms": fb * 1e3, "useful_fwd_tflop_per_s": useful / f / 1e12,
            "useful_fwd_bwd_tflop_per_s": 3 * useful / fb / 1e12}


report = {"batch": B, "seq": S, "anchors": A, "block": BK, "layers": L}
report["ceiling_tflop_per_s"] = ceiling(8192 if dev.type == "cuda" else 256)
input_ids = torch.randint(0, V, (B, S))
loss_mask = torch.ones(B, S, dtype=torch.int64)
loss_mask[:, 0] = 0
feats = torch.randn(B, S, NF * H, device=dev, dtype=dt)


def loss_check():
    """The loss over random inputs, as `dflash-host bench train` prints it: drafter outputs of std 1
    against the std-0.02 head give Gaussian logits and a loss of about ln V + sigma^2 / 2; and the
    fp32-output GEMM the loss used against the product in fp32."""
    anchors = torch.stack([torch.randperm(S - 1)[:A].sort().values for _ in range(B)]).to(dev)
    h = torch.randn(B, N, H, device=dev, dtype=dt)
    with torch.no_grad():
        loss, _ = dflash_loss(h, input_ids.to(dev), loss_mask.to(dev), anchors)
        rows = h.reshape(-1, H)[:384]
        z = torch.mm(rows, lm_head.T, out_dtype=torch.float32)
        want = rows.float() @ lm_head.float().T
        sigma = h.float().std().item() * lm_head.float().std().item() * H**0.5
    return {"loss": loss.item(), "expected": math.log(V) + sigma**2 / 2,
            "mm_out_dtype_rel_err": ((z - want).abs().max() / want.abs().max()).item()}


try:
    report["loss_check"] = loss_check()
except Exception as e:  # noqa: BLE001
    report["loss_check_error"] = repr(e)[:500]
torch.cuda.empty_cache()
print(json.dumps(report), flush=True)
for attn in args.attn_alone:
    try:
        if attn.startswith("flex") and flex is None:
            raise RuntimeError(flex_err)
        report[f"attention_{attn}"] = attention_alone(attn)
    except Exception as e:  # noqa: BLE001
        report[f"attention_{attn}_error"] = repr(e)[:500]
    torch.cuda.empty_cache()
    print(json.dumps(report), flush=True)
for attn in args.attn:
    if attn == "flex" and flex is None:
        report["flex_error"] = flex_err
        continue
    try:
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        t = timed(lambda: train_step(attn, input_ids, loss_mask, feats), args.warmup, args.iters)
        report[f"step_{attn}"] = {"step_s": t, "draft_tok_per_s": B * A * BK / t}
        if cuda:
            free, total = torch.cuda.mem_get_info()
            report[f"step_{attn}"].update({
                "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                "device_used_gib": (total - free) / 2**30,
            })
    except Exception as e:  # noqa: BLE001
        report[f"step_{attn}_error"] = repr(e)[:500]
    print(json.dumps(report), flush=True)

if args.target:
    del feats, P, params, master, opt
    torch.cuda.empty_cache()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg.pop("architectures", None)

    hf_cfg = AutoConfig.for_model(**cfg)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dt).eval()
    ids = input_ids.to(dev)
    with torch.no_grad():
        t = timed(lambda: model(ids), args.warmup, args.iters)
    report["hf_target_forward"] = {"step_s": t, "tok_per_s": B * S / t}

print("TORCH_BASELINE " + json.dumps(report), flush=True)
if args.json:
    json.dump(report, open(args.json, "w"), indent=1)
