#!/usr/bin/env python3
"""Reference fixtures for the Rust DFlash trainer, computed with PyTorch.

Writes these safetensors files (see tests/fixtures/README.md for the layout):

  dflash_loss.safetensors     a tiny random DFlash drafter (2 layers, hidden 64), its forward on
                              fixed inputs, the DFlash block loss, accuracy/tau_hat and parameter
                              gradients.
  dflash_global.safetensors   that drafter's gradients for one step of 3 micro-batches on each of
                              2 data-parallel ranks, normalised globally (one token-weighted mean).
  dflash_sliding.safetensors  that drafter with a sliding-window first layer: forward, loss,
                              gradients.
  rope.safetensors            transformers' RoPE scaling (linear, llama3, yarn) frequencies.
  adamw.safetensors           10 steps of torch.optim.AdamW (single-tensor path) with a cosine lr.
  muon.safetensors            10 steps of torch.optim.Muon on tall/wide/square matrices, both lr
                              scalings, with torch's bf16 Newton-Schulz and with a float32 one.

Everything runs on the CPU in float32 with one thread and deterministic algorithms, so the
numbers do not depend on any GPU. The reference code below is written from the DFlash spec
(block-diffusion drafter that attends to projected target hidden states), not taken from any
other project.

Usage (needs torch 2.11 and safetensors; transformers 5.8.1 for rope):
  python3 scripts/make_fixtures.py --out tests/fixtures
Only some files:  python3 scripts/make_fixtures.py --only muon --out tests/fixtures
"""

import argparse
import hashlib
import inspect
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

CONFIG = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "block_size": 4,
    "num_target_features": 3,
    "vocab_size": 101,
    "mask_token_id": 100,
    "loss_gamma": 2.0,
}


# ----------------------------------------------------------------------------------------------
# DFlash drafter reference
# ----------------------------------------------------------------------------------------------


def make_params(cfg):
    """Trainable parameters (ordered dict) and frozen tensors, from torch.manual_seed(0).

    Draw order: fc, hidden_norm, norm, then per layer q,k,v,o, q_norm, k_norm, gate, up, down,
    input_layernorm, post_attention_layernorm; then embed_tokens, lm_head.
    """
    torch.manual_seed(0)
    H = cfg["hidden_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    inter, nf, V = cfg["intermediate_size"], cfg["num_target_features"], cfg["vocab_size"]

    def lin(out_f, in_f, scale=0.1):
        return torch.randn(out_f, in_f) * scale

    def norm_w(n):
        return 1.0 + 0.1 * torch.randn(n)

    p = {}
    p["fc.weight"] = lin(H, nf * H, 0.05)
    p["hidden_norm.weight"] = norm_w(H)
    p["norm.weight"] = norm_w(H)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"layers.{i}."
        p[pre + "self_attn.q_proj.weight"] = lin(nh * hd, H)
        p[pre + "self_attn.k_proj.weight"] = lin(nkv * hd, H)
        p[pre + "self_attn.v_proj.weight"] = lin(nkv * hd, H)
        p[pre + "self_attn.o_proj.weight"] = lin(H, nh * hd)
        p[pre + "self_attn.q_norm.weight"] = norm_w(hd)
        p[pre + "self_attn.k_norm.weight"] = norm_w(hd)
        p[pre + "mlp.gate_proj.weight"] = lin(inter, H)
        p[pre + "mlp.up_proj.weight"] = lin(inter, H)
        p[pre + "mlp.down_proj.weight"] = lin(H, inter)
        p[pre + "input_layernorm.weight"] = norm_w(H)
        p[pre + "post_attention_layernorm.weight"] = norm_w(H)
    frozen = {
        "embed_tokens": torch.randn(V, H),
        "lm_head": torch.randn(V, H) * 0.5,
    }
    return p, frozen


def make_inputs(cfg, B=2, S=24):
    """Fixed inputs; random parts from torch.manual_seed(1) (target_hidden, then input_ids)."""
    torch.manual_seed(1)
    H, nf = cfg["hidden_size"], cfg["num_target_features"]
    target_hidden = torch.randn(B, S, nf * H)
    input_ids = torch.randint(0, 100, (B, S), dtype=torch.int64)
    loss_mask = torch.zeros(B, S, dtype=torch.int64)
    loss_mask[0, 8:] = 1
    loss_mask[1, 6:20] = 1
    anchors = torch.tensor([[8, 11, 15, 20, 22], [6, 9, 13, 18, 0]], dtype=torch.int64)
    anchor_valid = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.int64)
    return {
        "target_hidden": target_hidden,
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "anchors": anchors,
        "anchor_valid": anchor_valid,
    }


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_cos_sin(pos, hd, theta, dtype):
    """pos [B, T] int64 -> cos, sin [B, T, hd] (HF Llama/Qwen3 convention)."""
    exps = torch.arange(0, hd, 2, dtype=torch.int64).to(dtype) / hd  # 2i/hd, i < hd/2
    inv_freq = 1.0 / (theta ** exps)  # theta^(-2i/hd)
    freqs = pos.to(dtype)[..., None] * inv_freq  # [B, T, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [B, T, hd]
    return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x, cos, sin):
    """x [B, heads, T, hd]; cos/sin [B, T, hd]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def decoder_layer(p, i, x, ctx, pos_q, pos_k, mask, cfg):
    """One drafter layer. x [B,N,H] block tokens, ctx [B,S,H] projected context (not normed here),
    pos_q [B,N], pos_k [B,S+N], mask [B,N,S+N] bool (True = may attend) or None (attend to all)."""
    pre = f"layers.{i}."
    eps = cfg["rms_norm_eps"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    B, N, _ = x.shape
    S = ctx.shape[1]

    h = rms_norm(x, p[pre + "input_layernorm.weight"], eps)
    q = (h @ p[pre + "self_attn.q_proj.weight"].T).view(B, N, nh, hd)
    q = rms_norm(q, p[pre + "self_attn.q_norm.weight"], eps).transpose(1, 2)  # [B,nh,N,hd]
    kv_in = torch.cat([ctx, h], dim=1)  # [B,S+N,H]: context (un-normed) then the normed block
    k = (kv_in @ p[pre + "self_attn.k_proj.weight"].T).view(B, S + N, nkv, hd)
    k = rms_norm(k, p[pre + "self_attn.k_norm.weight"], eps).transpose(1, 2)  # [B,nkv,S+N,hd]
    v = (kv_in @ p[pre + "self_attn.v_proj.weight"].T).view(B, S + N, nkv, hd).transpose(1, 2)

    cos_q, sin_q = rope_cos_sin(pos_q, hd, cfg["rope_theta"], x.dtype)
    cos_k, sin_k = rope_cos_sin(pos_k, hd, cfg["rope_theta"], x.dtype)
    q = apply_rope(q, cos_q, sin_q)
    k = apply_rope(k, cos_k, sin_k)

    rep = nh // nkv  # query head h uses kv head h // rep: [kv0, kv0, kv1, kv1]
    T = S + N
    k = k[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)
    v = v[:, :, None].expand(B, nkv, rep, T, hd).reshape(B, nh, T, hd)
    scores = (q @ k.transpose(-1, -2)) * (hd ** -0.5)  # [B,nh,N,S+N]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
    attn = torch.softmax(scores, dim=-1) @ v  # [B,nh,N,hd]
    attn = attn.transpose(1, 2).reshape(B, N, nh * hd)
    x = x + attn @ p[pre + "self_attn.o_proj.weight"].T

    pn = rms_norm(x, p[pre + "post_attention_layernorm.weight"], eps)
    gate = pn @ p[pre + "mlp.gate_proj.weight"].T
    up = pn @ p[pre + "mlp.up_proj.weight"].T
    x = x + (F.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].T
    return x


def context_features(p, inp, cfg):
    """Step 1: ctx = hidden_norm(target_hidden @ fc^T) -> [B,S,H]."""
    return rms_norm(inp["target_hidden"] @ p["fc.weight"].T, p["hidden_norm.weight"], cfg["rms_norm_eps"])


def block_tokens(inp, cfg):
    """Block ids [B,N] (anchor token then mask tokens) and block positions [B,N] (a_j + k)."""
    anchors = inp["anchors"]
    B, A = anchors.shape
    Bk = cfg["block_size"]
    ids = torch.full((B, A, Bk), cfg["mask_token_id"], dtype=torch.int64)
    ids[:, :, 0] = torch.gather(inp["input_ids"], 1, anchors)
    pos = anchors[:, :, None] + torch.arange(Bk, dtype=torch.int64)
    return ids.reshape(B, A * Bk), pos.reshape(B, A * Bk)


def attention_mask(anchors, S, Bk):
    """[B, N, S+N] bool: block j sees context s < a_j and its own Bk block keys."""
    B, A = anchors.shape
    N = A * Bk
    blk = torch.arange(N) // Bk  # block index of each query / block key
    q_anchor = anchors[:, blk]  # [B,N]
    ctx_ok = torch.arange(S)[None, None, :] < q_anchor[:, :, None]  # [B,N,S]
    blk_ok = (blk[:, None] == blk[None, :])[None].expand(B, N, N)  # [B,N,N]
    return torch.cat([ctx_ok, blk_ok], dim=-1)


def forward_batched(p, frozen, inp, cfg):
    """Batched masked forward (the reference). Returns a dict of intermediates."""
    eps = cfg["rms_norm_eps"]
    Bk = cfg["block_size"]
    ctx = context_features(p, inp, cfg)
    B, S, _ = ctx.shape
    ids, pos_q = block_tokens(inp, cfg)
    x = frozen["embed_tokens"][ids]  # [B,N,H]
    pos_ctx = torch.arange(S, dtype=torch.int64)[None].expand(B, S)
    pos_k = torch.cat([pos_ctx, pos_q], dim=1)
    mask = attention_mask(inp["anchors"], S, Bk)
    layer_out = []
    for i in range(cfg["num_hidden_layers"]):
        x = decoder_layer(p, i, x, ctx, pos_q, pos_k, mask, cfg)
        layer_out.append(x)
    block_hidden = rms_norm(x, p["norm.weight"], eps)
    return {
        "ctx": ctx,
        "block_ids": ids,
        "block_pos": pos_q,
        "attn_mask": mask,
        "layer_out": layer_out,
        "block_hidden": block_hidden,
    }


def forward_naive(p, frozen, inp, cfg):
    """Per-block loop without any mask: block j of row b attends to ctx[b, :a_j] and itself."""
    eps = cfg["rms_norm_eps"]
    Bk = cfg["block_size"]
    ctx = context_features(p, inp, cfg)
    anchors = inp["anchors"]
    B, A = anchors.shape
    rows = []
    for b in range(B):
        blocks = []
        for j in range(A):
            a = int(anchors[b, j])
            tok = torch.tensor([int(inp["input_ids"][b, a])] + [cfg["mask_token_id"]] * (Bk - 1))
            x = frozen["embed_tokens"][tok][None]  # [1,Bk,H]
            c = ctx[b : b + 1, :a]  # [1,a,H] (may be empty)
            pos_q = (a + torch.arange(Bk, dtype=torch.int64))[None]
            pos_k = torch.cat([torch.arange(a, dtype=torch.int64)[None], pos_q], dim=1)
            for i in range(cfg["num_hidden_layers"]):
                x = decoder_layer(p, i, x, c, pos_q, pos_k, None, cfg)
            blocks.append(rms_norm(x, p["norm.weight"], eps)[0])
        rows.append(torch.cat(blocks, dim=0))
    return torch.stack(rows, dim=0)  # [B,N,H]


def dflash_loss(block_hidden, lm_head, inp, cfg):
    """Gamma-weighted block CE over positions 1..Bk-1, plus per-position top-1 accuracy."""
    input_ids, loss_mask = inp["input_ids"], inp["loss_mask"]
    anchors, anchor_valid = inp["anchors"], inp["anchor_valid"]
    B, S = input_ids.shape
    A = anchors.shape[1]
    Bk, V, gamma = cfg["block_size"], cfg["vocab_size"], cfg["loss_gamma"]
    dtype = block_hidden.dtype

    logits = (block_hidden @ lm_head.T).view(B, A, Bk, V)
    k = torch.arange(1, Bk, dtype=torch.int64)  # predicted offsets 1..Bk-1
    lpos = anchors[:, :, None] + k  # [B,A,Bk-1]
    in_range = lpos < S
    lpos_c = lpos.clamp(max=S - 1)
    labels = torch.gather(input_ids, 1, lpos_c.reshape(B, -1)).view(B, A, Bk - 1)
    lmask = torch.gather(loss_mask, 1, lpos_c.reshape(B, -1)).view(B, A, Bk - 1)
    valid = (anchor_valid[:, :, None] == 1) & in_range & (lmask == 1)

    w = torch.exp(-(k - 1).to(dtype) / gamma)  # [Bk-1]
    lg = logits[:, :, 1:, :]
    ce = F.cross_entropy(lg.reshape(-1, V), labels.reshape(-1), reduction="none").view(B, A, Bk - 1)
    wv = valid.to(dtype) * w
    loss = (wv * ce).sum() / wv.sum()

    with torch.no_grad():
        pred = lg.argmax(dim=-1)  # [B,A,Bk-1]
        correct = (pred == labels) & valid
        valid_count = valid.sum(dim=(0, 1)).to(torch.int64)  # [Bk-1]
        acc = correct.sum(dim=(0, 1)).to(dtype) / valid_count.clamp(min=1).to(dtype)
        tau_hat = 1.0 + torch.cumprod(acc, dim=0).sum()
    return {
        "loss": loss,
        "weight_sum": wv.sum(),
        "logits": logits,
        "labels": torch.where(in_range, labels, torch.full_like(labels, -1)),
        "valid": valid.to(torch.int64),
        "ce": ce,
        "pred": pred,
        "acc": acc,
        "valid_count": valid_count,
        "tau_hat": tau_hat,
    }


def make_dflash_fixture(out_dir):
    cfg = CONFIG
    params, frozen = make_params(cfg)
    inp = make_inputs(cfg)

    # --- sanity check in float64: batched masked forward == naive per-block loop -------------
    p64 = {k: v.double() for k, v in params.items()}
    f64 = {k: v.double() for k, v in frozen.items()}
    inp64 = dict(inp, target_hidden=inp["target_hidden"].double())
    with torch.no_grad():
        fb64 = forward_batched(p64, f64, inp64, cfg)
        bh_naive64 = forward_naive(p64, f64, inp64, cfg)
        loss_b64 = dflash_loss(fb64["block_hidden"], f64["lm_head"], inp64, cfg)["loss"]
        loss_n64 = dflash_loss(bh_naive64, f64["lm_head"], inp64, cfg)["loss"]
    d_loss64 = abs(float(loss_b64) - float(loss_n64))
    d_bh64 = float((fb64["block_hidden"] - bh_naive64).abs().max())
    print(f"[sanity f64] loss batched={float(loss_b64):.15f} naive={float(loss_n64):.15f} "
          f"|diff|={d_loss64:.3e}; block_hidden max|diff|={d_bh64:.3e}")
    assert d_loss64 < 1e-6, "float64 batched vs naive loss mismatch (mask bug?)"
    assert d_bh64 < 1e-6, "float64 batched vs naive block_hidden mismatch (mask bug?)"

    # --- the float32 reference with gradients ----------------------------------------------
    p32 = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    fb = forward_batched(p32, frozen, inp, cfg)
    res = dflash_loss(fb["block_hidden"], frozen["lm_head"], inp, cfg)
    res["loss"].backward()

    with torch.no_grad():
        bh_naive = forward_naive(p32, frozen, inp, cfg)
        loss_n = dflash_loss(bh_naive, frozen["lm_head"], inp, cfg)["loss"]
    d_loss32 = abs(float(res["loss"]) - float(loss_n))
    d_bh32 = float((fb["block_hidden"] - bh_naive).abs().max())
    print(f"[sanity f32] loss batched={float(res['loss']):.9f} naive={float(loss_n):.9f} "
          f"|diff|={d_loss32:.3e}; block_hidden max|diff|={d_bh32:.3e}")
    print(f"[sanity f32 vs f64] |loss32 - loss64| = {abs(float(res['loss']) - float(loss_b64)):.3e}")
    # float32 differs only by summation order; the strict (1e-6) check is the float64 one above.
    assert d_loss32 <= 1e-4 * max(1.0, abs(float(loss_n))), "float32 batched vs naive loss mismatch"
    assert d_bh32 < 1e-4, "float32 batched vs naive block_hidden mismatch"

    print(f"[dflash] loss={float(res['loss']):.7f} acc={res['acc'].tolist()} "
          f"valid_count={res['valid_count'].tolist()} tau_hat={float(res['tau_hat']):.6f}")

    t = {}
    for name, v in params.items():
        t[name] = v
    for name, v in inp.items():
        t["in." + name] = v
    for name, v in frozen.items():
        t["frozen." + name] = v
    t["out.ctx"] = fb["ctx"]
    t["out.block_ids"] = fb["block_ids"]
    t["out.block_pos"] = fb["block_pos"]
    t["out.attn_mask"] = fb["attn_mask"].to(torch.uint8)
    for i, x in enumerate(fb["layer_out"]):
        t[f"out.layer_out.{i}"] = x
    t["out.block_hidden"] = fb["block_hidden"]
    t["out.logits"] = res["logits"]
    t["out.labels"] = res["labels"]
    t["out.label_valid"] = res["valid"]
    t["out.ce"] = res["ce"]
    t["out.pred"] = res["pred"]
    t["out.loss"] = res["loss"].reshape(())
    t["out.loss_f64"] = loss_b64.reshape(())
    t["out.acc"] = res["acc"]
    t["out.valid_count"] = res["valid_count"]
    t["out.tau_hat"] = res["tau_hat"].reshape(())
    for name, v in p32.items():
        assert v.grad is not None, name
        t["grad." + name] = v.grad
    t = {k: v.detach().contiguous() for k, v in t.items()}

    meta = {
        "config": json.dumps(cfg),
        "torch_version": torch.__version__,
        "generator": "scripts/make_fixtures.py",
        "sanity_f64_loss_abs_diff": f"{d_loss64:.3e}",
        "sanity_f32_loss_abs_diff": f"{d_loss32:.3e}",
    }
    path = os.path.join(out_dir, "dflash_loss.safetensors")
    save_file(t, path, metadata=meta)
    return path, t


# ----------------------------------------------------------------------------------------------
# One optimizer step normalised globally: K = 3 micro-batches on each of 2 data-parallel ranks
# ----------------------------------------------------------------------------------------------

# (rank, micro-batch) -> rows of response spans [first, end) in S = 16 positions. The anchors are
# every response token whose next token is one too (the trainer's rule; with anchors_per_seq
# above their number it takes them all), so the Rust test runs the trainer's own sampling.
# Label counts differ a lot between micro-batches (one label up to 63), so the mean of
# per-micro-batch means and the token-weighted mean of the step differ clearly.
GLOBAL_S = 16
GLOBAL_BATCHES = {
    (0, 0): [(2, 16), (5, 16)],
    (0, 1): [(13, 15)],
    (0, 2): [(10, 16)],
    (1, 0): [(14, 16)],
    (1, 1): [(1, 16), (6, 12)],
    (1, 2): [(9, 13)],
}


def global_inputs(cfg):
    """Each micro-batch's inputs; random parts from torch.manual_seed(2), in GLOBAL_BATCHES order."""
    torch.manual_seed(2)
    H, nf, S = cfg["hidden_size"], cfg["num_target_features"], GLOBAL_S
    out = {}
    for key, rows in GLOBAL_BATCHES.items():
        B = len(rows)
        target_hidden = torch.randn(B, S, nf * H)
        input_ids = torch.randint(0, 100, (B, S), dtype=torch.int64)
        loss_mask = torch.zeros(B, S, dtype=torch.int64)
        for b, (first, end) in enumerate(rows):
            loss_mask[b, first:end] = 1
        picked = [[p for p in range(S - 1) if loss_mask[b, p] and loss_mask[b, p + 1]] for b in range(B)]
        A = max(len(r) for r in picked)
        anchors = torch.tensor([r + [0] * (A - len(r)) for r in picked], dtype=torch.int64)
        anchor_valid = torch.tensor([[1] * len(r) + [0] * (A - len(r)) for r in picked], dtype=torch.int64)
        out[key] = {"target_hidden": target_hidden, "input_ids": input_ids, "loss_mask": loss_mask,
                    "anchors": anchors, "anchor_valid": anchor_valid}
    return out


def make_global_fixture(out_dir):
    """The step's gradient the global way (SpecForge's): every micro-batch's weighted CE summed,
    over the weight sum of all six. The drafter is dflash_loss.safetensors' (same seed)."""
    cfg = CONFIG
    params, frozen = make_params(cfg)
    inputs = global_inputs(cfg)
    p32 = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    nums, dens, means = {}, {}, {}
    for key, inp in inputs.items():
        fb = forward_batched(p32, frozen, inp, cfg)
        res = dflash_loss(fb["block_hidden"], frozen["lm_head"], inp, cfg)
        den = res["weight_sum"]
        nums[key], dens[key], means[key] = res["loss"] * den, den.detach(), res["loss"]
    total_den = sum(dens.values())
    loss = sum(nums.values()) / total_den
    loss.backward(retain_graph=True)
    grads = {k: v.grad.clone() for k, v in p32.items()}

    # The other normalisation, for contrast: the mean of the six micro-batch means.
    for v in p32.values():
        v.grad = None
    per_micro = sum(means.values()) / len(means)
    per_micro.backward()
    rel = max(float((p32[k].grad - grads[k]).norm() / grads[k].norm()) for k in grads)
    print(f"[global] loss={float(loss.detach()):.7f} per-micro-batch mean={float(per_micro.detach()):.7f} "
          f"weight sums={[round(float(d), 4) for d in dens.values()]} max rel grad diff between the two={rel:.3f}")
    assert rel > 0.05, "the fixture does not tell the two normalisations apart"

    t = {}
    for (r, m), inp in inputs.items():
        for name, v in inp.items():
            t[f"in.r{r}.m{m}.{name}"] = v
        t[f"out.r{r}.m{m}.weight_sum"] = dens[(r, m)].reshape(())
    t["out.loss"] = loss.reshape(())
    t["out.loss_per_micro_batch"] = per_micro.reshape(())
    t["out.weight_sum"] = total_den.reshape(())
    for name, g in grads.items():
        t["grad." + name] = g
    t = {k: v.detach().contiguous() for k, v in t.items()}
    meta = {
        "config": json.dumps(cfg),
        "batches": json.dumps({f"r{r}.m{m}": rows for (r, m), rows in GLOBAL_BATCHES.items()}),
        "torch_version": torch.__version__,
        "generator": "scripts/make_fixtures.py",
    }
    path = os.path.join(out_dir, "dflash_global.safetensors")
    save_file(t, path, metadata=meta)
    return path, t


# ----------------------------------------------------------------------------------------------
# A sliding-window drafter: layer 0 `sliding_attention` (window 6), layer 1 `full_attention`
# ----------------------------------------------------------------------------------------------

SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}


def sliding_mask(anchors, S, Bk, W):
    """[B, N, S+N] bool: the query at position p = a_j + i sees positions p-W+1..=p: context keys
    s in [p-W+1, a_j) and its own block's keys 0..=i (causal, as SGLang serves such a layer)."""
    B, A = anchors.shape
    N = A * Bk
    blk = torch.arange(N) // Bk
    off = torch.arange(N) % Bk
    q_anchor = anchors[:, blk]  # [B,N]
    s = torch.arange(S)[None, None, :]
    lo = (q_anchor + off[None, :] - (W - 1))[:, :, None]
    ctx_ok = (s < q_anchor[:, :, None]) & (s >= lo)
    blk_ok = (blk[:, None] == blk[None, :]) & (off[None, :] <= off[:, None])
    return torch.cat([ctx_ok, blk_ok[None].expand(B, N, N)], dim=-1)


def forward_layer_masks(p, frozen, inp, cfg, masks):
    """The batched forward with one mask per layer; returns block_hidden."""
    ctx = context_features(p, inp, cfg)
    B, S, _ = ctx.shape
    ids, pos_q = block_tokens(inp, cfg)
    x = frozen["embed_tokens"][ids]
    pos_k = torch.cat([torch.arange(S, dtype=torch.int64)[None].expand(B, S), pos_q], dim=1)
    for i in range(cfg["num_hidden_layers"]):
        x = decoder_layer(p, i, x, ctx, pos_q, pos_k, masks[i], cfg)
    return rms_norm(x, p["norm.weight"], cfg["rms_norm_eps"])


def forward_served(p, frozen, inp, cfg, windows):
    """Per block, as a server drafts it: the context's keys at 0..a-1 then the block's at
    a..a+Bk-1, and per layer a mask by position only (full: the context and the whole block;
    window W: key positions p-W+1..=p of the query at p)."""
    Bk = cfg["block_size"]
    ctx = context_features(p, inp, cfg)
    anchors = inp["anchors"]
    B, A = anchors.shape
    rows = []
    for b in range(B):
        blocks = []
        for j in range(A):
            a = int(anchors[b, j])
            tok = torch.tensor([int(inp["input_ids"][b, a])] + [cfg["mask_token_id"]] * (Bk - 1))
            x = frozen["embed_tokens"][tok][None]
            c = ctx[b : b + 1, :a]
            pos_q = (a + torch.arange(Bk, dtype=torch.int64))[None]
            pos_k = torch.cat([torch.arange(a, dtype=torch.int64)[None], pos_q], dim=1)
            for i in range(cfg["num_hidden_layers"]):
                W = windows[i]
                if W is None:
                    mask = None
                else:
                    qp, kp = pos_q[0][:, None], pos_k[0][None, :]
                    mask = ((kp <= qp) & (kp > qp - W))[None]
                x = decoder_layer(p, i, x, c, pos_q, pos_k, mask, cfg)
            blocks.append(rms_norm(x, p["norm.weight"], cfg["rms_norm_eps"])[0])
        rows.append(torch.cat(blocks, dim=0))
    return torch.stack(rows, dim=0)


def make_sliding_fixture(out_dir):
    """dflash_loss.safetensors' drafter and inputs with layer 0 sliding (window 6): forward, loss,
    gradients. Checked in float64 against a per-block loop with masks by position only."""
    cfg = CONFIG
    params, frozen = make_params(cfg)
    inp = make_inputs(cfg)
    S, Bk, W = inp["input_ids"].shape[1], cfg["block_size"], SLIDING["sliding_window"]
    windows = [W if t == "sliding_attention" else None for t in SLIDING["layer_types"]]
    masks = [sliding_mask(inp["anchors"], S, Bk, w) if w else attention_mask(inp["anchors"], S, Bk) for w in windows]

    p64 = {k: v.double() for k, v in params.items()}
    f64 = {k: v.double() for k, v in frozen.items()}
    inp64 = dict(inp, target_hidden=inp["target_hidden"].double())
    with torch.no_grad():
        batched = forward_layer_masks(p64, f64, inp64, cfg, masks)
        served = forward_served(p64, f64, inp64, cfg, windows)
        full = forward_batched(p64, f64, inp64, cfg)["block_hidden"]
    d64 = float((batched - served).abs().max())
    cut = float((batched - full).abs().max())
    print(f"[sliding f64] batched vs served max|diff|={d64:.3e}; vs the full-attention drafter {cut:.3e}")
    assert d64 < 1e-10, "sliding mask differs from the per-block served form"
    assert cut > 1e-2, "the window cuts nothing here"

    p32 = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    bh = forward_layer_masks(p32, frozen, inp, cfg, masks)
    res = dflash_loss(bh, frozen["lm_head"], inp, cfg)
    res["loss"].backward()
    print(f"[sliding] loss={float(res['loss']):.7f}")
    t = {"out.block_hidden": bh, "out.loss": res["loss"].reshape(())}
    for name, v in p32.items():
        t["grad." + name] = v.grad
    t = {k: v.detach().contiguous() for k, v in t.items()}
    meta = {
        "config": json.dumps(dict(cfg, **SLIDING)),
        "torch_version": torch.__version__,
        "generator": "scripts/make_fixtures.py",
        "sanity_f64_served_max_abs_diff": f"{d64:.3e}",
    }
    path = os.path.join(out_dir, "dflash_sliding.safetensors")
    save_file(t, path, metadata=meta)
    return path, t


# ----------------------------------------------------------------------------------------------
# RoPE scaling: transformers' inverse frequencies and attention factor per kind
# ----------------------------------------------------------------------------------------------

ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                    "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 0.5,
                    "truncate": False},
}


def make_rope_fixture(out_dir):
    """inv_freq and the cos/sin factor of transformers 5's ROPE_INIT_FUNCTIONS for a Qwen3 config
    with head_dim 16, rope_theta 1e4, max_position_embeddings 256 (needs transformers)."""
    import transformers
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    t, factors = {}, {}
    for name, scaling in ROPE_CASES.items():
        params = dict(scaling, rope_theta=10000.0)
        config = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                             rope_parameters=params)
        inv_freq, attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
        t[f"inv_freq.{name}"] = inv_freq.float().contiguous()
        factors[name] = float(attention)
    print(f"[rope] attention factors {factors}")
    meta = {
        "cases": json.dumps(ROPE_CASES),
        "attention_factor": json.dumps(factors),
        "head_dim": "16",
        "rope_theta": "10000.0",
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "generator": "scripts/make_fixtures.py",
    }
    path = os.path.join(out_dir, "rope.safetensors")
    save_file(t, path, metadata=meta)
    return path, t


# ----------------------------------------------------------------------------------------------
# AdamW reference
# ----------------------------------------------------------------------------------------------

ADAMW_SHAPES = {"p.w": (5, 7), "p.b": (7,), "p.m": (3, 4, 2)}
ADAMW_HYPER = {"betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "maximize": False, "foreach": False, "fused": False, "steps": 10, "lr_max": 1e-2}


def adamw_lr(t, steps=10, lr_max=1e-2):
    return lr_max * (0.5 * (1.0 + math.cos(math.pi * (t - 1) / steps)))


def manual_adamw(init, grads, lrs, dtype):
    """Hand-written AdamW (decoupled decay), for a cross-check of torch's numbers. Per step t:
        p   *= 1 - lr * wd
        m    = m + (1 - b1) * (g - m)                      (= b1 m + (1 - b1) g)
        v    = b2 v + (1 - b2) g^2
        p   -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    with the bias corrections and lr as float64 scalars (as torch's single-tensor path does)."""
    b1, b2 = ADAMW_HYPER["betas"]
    eps, wd = ADAMW_HYPER["eps"], ADAMW_HYPER["weight_decay"]
    out = {}
    for n, p0 in init.items():
        p = p0.to(dtype).clone()
        m = torch.zeros_like(p)
        v = torch.zeros_like(p)
        hist = []
        for t, lr in enumerate(lrs, start=1):
            g = grads[(n, t)].to(dtype)
            p = p * (1 - lr * wd)
            m = m + (1 - b1) * (g - m)
            v = v * b2 + (1 - b2) * g * g
            step_size = lr / (1 - b1 ** t)
            denom = v.sqrt() / math.sqrt(1 - b2 ** t) + eps
            p = p - step_size * (m / denom)
            hist.append(p.clone())
        out[n] = (hist, m, v)
    return out


def make_adamw_fixture(out_dir):
    steps = ADAMW_HYPER["steps"]
    torch.manual_seed(0)
    init = {n: torch.randn(*s) for n, s in ADAMW_SHAPES.items()}
    grads = {}
    for t in range(1, steps + 1):
        for n, s in ADAMW_SHAPES.items():
            grads[(n, t)] = torch.randn(*s)
    lrs = [adamw_lr(t, steps, ADAMW_HYPER["lr_max"]) for t in range(1, steps + 1)]

    params = {n: torch.nn.Parameter(init[n].clone()) for n in ADAMW_SHAPES}
    opt = torch.optim.AdamW(
        list(params.values()),
        lr=lrs[0],
        betas=tuple(ADAMW_HYPER["betas"]),
        eps=ADAMW_HYPER["eps"],
        weight_decay=ADAMW_HYPER["weight_decay"],
        amsgrad=False,
        maximize=False,
        foreach=False,
        fused=False,
    )
    t_out = {}
    for n in ADAMW_SHAPES:
        t_out[f"init.{n}"] = init[n].clone()
    for t in range(1, steps + 1):
        opt.param_groups[0]["lr"] = lrs[t - 1]
        for n, p in params.items():
            p.grad = grads[(n, t)].clone()
            t_out[f"grad.{n}.{t}"] = grads[(n, t)].clone()
        opt.step()
        for n, p in params.items():
            t_out[f"param.{n}.{t}"] = p.detach().clone()
    for n, p in params.items():
        st = opt.state[p]
        t_out[f"exp_avg.{n}"] = st["exp_avg"].detach().clone()
        t_out[f"exp_avg_sq.{n}"] = st["exp_avg_sq"].detach().clone()
        assert float(st["step"]) == steps
    t_out["lr"] = torch.tensor(lrs, dtype=torch.float32)

    # Cross-check against a hand-written AdamW (float32 and float64).
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-5)):
        ref = manual_adamw(init, grads, lrs, dtype)
        worst = 0.0
        for n in ADAMW_SHAPES:
            hist, m, v = ref[n]
            for t in range(1, steps + 1):
                worst = max(worst, float((hist[t - 1].double() - t_out[f"param.{n}.{t}"].double()).abs().max()))
            worst = max(worst, float((m.double() - t_out[f"exp_avg.{n}"].double()).abs().max()))
            worst = max(worst, float((v.double() - t_out[f"exp_avg_sq.{n}"].double()).abs().max()))
        print(f"[sanity adamw] torch vs manual {str(dtype).replace('torch.', '')}: max|diff|={worst:.3e}")
        assert worst < tol, "AdamW manual cross-check failed"

    t_out = {k: v.contiguous() for k, v in t_out.items()}
    meta = {
        "hyper": json.dumps(ADAMW_HYPER),
        "lr": json.dumps(lrs),  # the exact (float64) learning rates given to torch
        "torch_version": torch.__version__,
        "generator": "scripts/make_fixtures.py",
    }
    path = os.path.join(out_dir, "adamw.safetensors")
    save_file(t_out, path, metadata=meta)
    return path, t_out

# ----------------------------------------------------------------------------------------------
# Muon reference
# ----------------------------------------------------------------------------------------------

MUON_SHAPES = {"tall": (12, 5), "wide": (5, 12), "square": (8, 8)}
MUON_HYPER = {"momentum": 0.95, "nesterov": True, "weight_decay": 0.1, "ns_steps": 5, "eps": 1e-7,
              "ns_coefficients": [3.4445, -4.7750, 2.0315], "steps": 10, "lr_max": 2e-2}
# Fixture prefix -> torch's adjust_lr_fn. None is torch's default, the "original" scaling.
MUON_ADJUST = {"original": None, "match_rms_adamw": "match_rms_adamw"}


def newton_schulz(grad, ns_coefficients, ns_steps, eps, dtype):
    """torch 2.11's Newton-Schulz (torch/optim/_muon.py) computed in `dtype` (torch: bfloat16),
    the same operations in the same order: transpose a tall matrix; divide by the Frobenius norm
    clamped below at eps; then ns_steps times A = X X^T, B = b A + c A A and X = a X + B X, the
    last two as fused addmm calls (one rounding each), as torch does."""
    a, b, c = ns_coefficients
    x = grad.to(dtype, copy=True)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def newton_schulz_f32(grad, ns_coefficients, ns_steps, eps, *_unused):
    """Drop-in for torch's Newton-Schulz (same arguments), in float32."""
    return newton_schulz(grad, ns_coefficients, ns_steps, eps, torch.float32)


def torch_newton_schulz(g):
    """torch.optim.Muon's own Newton-Schulz on g, with this fixture's hyper-parameters."""
    fn = torch.optim._muon._zeropower_via_newtonschulz
    kw = {"use_addmm": False} if "use_addmm" in inspect.signature(fn).parameters else {}
    return fn(g, tuple(MUON_HYPER["ns_coefficients"]), MUON_HYPER["ns_steps"], MUON_HYPER["eps"], **kw)


def run_torch_muon(init, grads, lrs, adjust_lr_fn, ns=None):
    """10 steps of torch.optim.Muon; with `ns`, its Newton-Schulz is swapped for `ns` (the module
    global that _single_tensor_muon calls). Returns params after each step and the buffers."""
    h = MUON_HYPER
    params = {n: torch.nn.Parameter(init[n].clone()) for n in MUON_SHAPES}
    opt = torch.optim.Muon(
        list(params.values()),
        lr=lrs[0],
        weight_decay=h["weight_decay"],
        momentum=h["momentum"],
        nesterov=h["nesterov"],
        ns_coefficients=tuple(h["ns_coefficients"]),
        eps=h["eps"],
        ns_steps=h["ns_steps"],
        adjust_lr_fn=adjust_lr_fn,
    )
    module = torch.optim._muon
    original = module._zeropower_via_newtonschulz
    if ns is not None:
        module._zeropower_via_newtonschulz = ns
    try:
        hist = {}
        for t in range(1, h["steps"] + 1):
            opt.param_groups[0]["lr"] = lrs[t - 1]
            for n, p in params.items():
                p.grad = grads[(n, t)].clone()
            opt.step()
            for n, p in params.items():
                hist[(n, t)] = p.detach().clone()
    finally:
        module._zeropower_via_newtonschulz = original
    bufs = {n: opt.state[p]["momentum_buffer"].detach().clone() for n, p in params.items()}
    return hist, bufs


def manual_muon(init, grads, lrs, adjust, dtype):
    """Hand-written Muon in `dtype` throughout (Newton-Schulz included), for a cross-check:
        buf = mu buf + (1 - mu) g;   u = (1 - mu) g + mu buf   (Nesterov)
        O = NS5(u) with X0 = u / (||u||_F + eps)   (KellerJordan's normalisation)
        p *= 1 - lr wd;   p -= lr * ratio * O
    ratio: original sqrt(max(1, rows/cols)); match_rms_adamw 0.2 sqrt(max(rows, cols))."""
    h = MUON_HYPER
    mu, wd, eps = h["momentum"], h["weight_decay"], h["eps"]
    a, b, c = h["ns_coefficients"]

    def ns5(g):
        x = g.T if g.shape[0] > g.shape[1] else g
        x = x / (x.norm() + eps)
        for _ in range(h["ns_steps"]):
            s = x @ x.T
            x = a * x + (b * s + c * (s @ s)) @ x
        return x.T if g.shape[0] > g.shape[1] else x

    out = {}
    for n, p0 in init.items():
        rows, cols = p0.shape
        ratio = math.sqrt(max(1.0, rows / cols)) if adjust == "original" else 0.2 * math.sqrt(max(rows, cols))
        p = p0.to(dtype).clone()
        buf = torch.zeros_like(p)
        for t, lr in enumerate(lrs, start=1):
            g = grads[(n, t)].to(dtype)
            buf = mu * buf + (1 - mu) * g
            u = (1 - mu) * g + mu * buf
            p = p * (1 - lr * wd) - (lr * ratio) * ns5(u)
            out[(n, t)] = p.clone()
        out[("buf", n)] = buf
    return out


def make_muon_fixture(out_dir):
    h = MUON_HYPER
    steps = h["steps"]
    torch.manual_seed(2)
    init = {n: torch.randn(*s) for n, s in MUON_SHAPES.items()}
    grads = {}
    for t in range(1, steps + 1):
        for n, s in MUON_SHAPES.items():
            grads[(n, t)] = torch.randn(*s)
    lrs = [adamw_lr(t, steps, h["lr_max"]) for t in range(1, steps + 1)]

    # Which dtype does torch's Newton-Schulz use on the CPU? (2.11: x = grad.bfloat16(), always.)
    ns_dtype = torch_newton_schulz(grads[("tall", 1)]).dtype
    print(f"[muon] torch.optim.Muon Newton-Schulz dtype for a float32 CPU gradient: {ns_dtype}")
    source = inspect.getsource(torch.optim._muon)

    # The function above in bfloat16 reproduces torch's own, so the float32 variant differs from
    # torch in the dtype only.
    same_as_torch = all(
        torch.equal(newton_schulz(grads[(n, 1)], h["ns_coefficients"], h["ns_steps"], h["eps"], torch.bfloat16),
                    torch_newton_schulz(grads[(n, 1)]))
        for n in MUON_SHAPES)
    print(f"[sanity muon] newton_schulz(.., bfloat16) == torch's Newton-Schulz, bit for bit: {same_as_torch}")

    t_out = {}
    for n in MUON_SHAPES:
        t_out[f"init.{n}"] = init[n].clone()
        for t in range(1, steps + 1):
            t_out[f"grad.{n}.{t}"] = grads[(n, t)].clone()
        t_out[f"ns.bf16.{n}"] = torch_newton_schulz(grads[(n, 1)]).float()
        t_out[f"ns.f32.{n}"] = newton_schulz_f32(grads[(n, 1)], h["ns_coefficients"], h["ns_steps"], h["eps"])
    sanity = {}
    bufs_seen = []
    for prefix, adjust_lr_fn in MUON_ADJUST.items():
        for kind, ns in (("bf16", None), ("f32", newton_schulz_f32)):
            hist, bufs = run_torch_muon(init, grads, lrs, adjust_lr_fn, ns)
            for (n, t), p in hist.items():
                t_out[f"{prefix}.{kind}.param.{n}.{t}"] = p
            bufs_seen.append(bufs)
        # Cross-check: hand-written float64 Muon vs torch with the float32 / bf16 Newton-Schulz.
        ref = manual_muon(init, grads, lrs, prefix, torch.float64)
        for kind in ("f32", "bf16"):
            worst = max(float((ref[(n, t)] - t_out[f"{prefix}.{kind}.param.{n}.{t}"].double()).abs().max())
                        for n in MUON_SHAPES for t in range(1, steps + 1))
            sanity[f"{prefix}.{kind}"] = worst
            print(f"[sanity muon] {prefix}: torch ({kind} Newton-Schulz) vs manual f64: max|diff| params={worst:.3e}")
        assert sanity[f"{prefix}.f32"] < 1e-5, "Muon manual cross-check (float32 Newton-Schulz) failed"
        assert sanity[f"{prefix}.bf16"] > 10 * sanity[f"{prefix}.f32"], "the Newton-Schulz swap had no effect"
    # The momentum buffers depend on the gradients only: one set for every run.
    for bufs in bufs_seen[1:]:
        for n in MUON_SHAPES:
            assert torch.equal(bufs[n], bufs_seen[0][n]), n
    for n in MUON_SHAPES:
        t_out[f"momentum_buffer.{n}"] = bufs_seen[0][n]
        assert float((ref[("buf", n)] - bufs_seen[0][n].double()).abs().max()) < 1e-6, n
    t_out["lr"] = torch.tensor(lrs, dtype=torch.float32)

    t_out = {k: v.contiguous() for k, v in t_out.items()}
    meta = {
        "hyper": json.dumps(h),
        "adjust_lr_fn": json.dumps(MUON_ADJUST),
        "lr": json.dumps(lrs),  # the exact (float64) learning rates given to torch
        "torch_ns_dtype_cpu": str(ns_dtype).replace("torch.", ""),
        "sanity_ns_bf16_bitwise_equal_torch": json.dumps(same_as_torch),
        "torch_muon_source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "sanity_manual_f64_max_abs_diff": json.dumps({k: f"{v:.3e}" for k, v in sanity.items()}),
        "torch_version": torch.__version__,
        "generator": "scripts/make_fixtures.py",
    }
    path = os.path.join(out_dir, "muon.safetensors")
    save_file(t_out, path, metadata=meta)
    return path, t_out


def main():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(repo, "tests", "fixtures"), help="output folder")
    makers = {"dflash": make_dflash_fixture, "adamw": make_adamw_fixture, "muon": make_muon_fixture,
              "global": make_global_fixture, "sliding": make_sliding_fixture, "rope": make_rope_fixture}
    ap.add_argument("--only", action="append", choices=list(makers),
                    help="make only this fixture (repeatable); default: all, in the order listed")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, device cpu")

    for name, make in makers.items():
        if args.only and name not in args.only:
            continue
        path, tensors = make(args.out)
        print(f"wrote {path}: {os.path.getsize(path)} bytes, {len(tensors)} tensors")
        for k, v in tensors.items():
            print(f"  {k} {str(v.dtype).replace('torch.', '')} {list(v.shape)}")


if __name__ == "__main__":
    main()
