//! The dense parts of a DFlash drafter (z-lab / Qwen3 weight names): RMSNorm, RoPE, DFlash block
//! attention and the SwiGLU MLP.

use crate::rope::RopeScaling;
use plugin_api::tch::{nn, nn::Module, no_grad, Kind, Tensor};
use std::sync::atomic::AtomicBool;

/// The shape of a dense decoder layer.
#[derive(Debug, Clone, Copy)]
pub struct DenseShape {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub rms_norm_eps: f64,
    /// HF's `initializer_range`: the std of the linear layers' random initialisation.
    pub initializer_range: f64,
}

/// RMSNorm over the last dim, computed in fp32 (Qwen3RMSNorm). libtorch's `rms_norm` runs its
/// fused kernel on CUDA (one pass forward, one backward, only the inverse RMS saved) and HF's
/// upcast-normalise-downcast-scale sequence elsewhere, which on CUDA would cost six passes and an
/// fp32 copy of the input per norm.
#[derive(Debug)]
pub struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn new(p: nn::Path, dim: i64, eps: f64) -> Self {
        Self { weight: p.ones("weight", &[dim]), eps }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.rms_norm(self.weight.size(), Some(&self.weight), self.eps)
    }

    /// (s, norm of s) with s = x + delta: a residual add and the norm after it, outside autograd.
    /// One kernel on a GPU (`kernels::rms_norm`), the add and [`forward`](Self::forward) elsewhere.
    pub fn forward_add(&self, x: &Tensor, delta: &Tensor) -> (Tensor, Tensor) {
        static FAILED: AtomicBool = AtomicBool::new(false);
        let kernel = || kernels::rms_norm::add_forward(x, delta, &self.weight, self.eps);
        let fused =
            kernels::rms_norm::applies(x).then(|| kernels::nvrtc::try_kernel(&FAILED, "the RMSNorm kernel", kernel));
        fused.flatten().unwrap_or_else(|| {
            let s = x + delta;
            let y = self.forward(&s);
            (s, y)
        })
    }

    /// The norm's backward from dy = dLoss/dy, plus the gradient g that reaches x around it (the
    /// residual's): (g + dLoss/dx through the norm, dLoss/d(weight) in the weight's kind). With
    /// a = dy w, r = 1 / rms(x), xn = x r: dx = r (a - xn mean(a xn)); dw = sum dy xn.
    pub fn backward_add(&self, x: &Tensor, dy: &Tensor, g: &Tensor) -> (Tensor, Tensor) {
        static FAILED: AtomicBool = AtomicBool::new(false);
        let kernel = || kernels::rms_norm::backward_add(x, &self.weight, self.eps, dy, g);
        let fused =
            kernels::rms_norm::applies(x).then(|| kernels::nvrtc::try_kernel(&FAILED, "the RMSNorm kernel", kernel));
        let (dx, dw) = fused.flatten().unwrap_or_else(|| {
            let (dx, dw) = self.composite_backward(x, dy);
            (dx + g.to_kind(dw.kind()), dw)
        });
        (dx.to_kind(x.kind()), dw.to_kind(self.weight.kind()))
    }

    /// The norm's backward by libtorch's ops, in fp32 (fp64 for fp64 x), from dy = dLoss/d(norm
    /// output): (dLoss/dx, dLoss/d(weight)) in that kind. With a = dy w, r = 1 / rms(x), xn = x
    /// r: dx = r (a - xn mean(a xn)); dw = sum dy xn over every dim but the last.
    fn composite_backward(&self, x: &Tensor, dy: &Tensor) -> (Tensor, Tensor) {
        let wk = work_kind(x);
        let xf = x.to_kind(wk);
        let r = (xf.square().mean_dim(-1, true, wk) + self.eps).rsqrt();
        let xn = &xf * &r;
        let dy = dy.to_kind(wk);
        let rows: Vec<i64> = (0..x.dim() as i64 - 1).collect();
        let dw = (&dy * &xn).sum_dim_intlist(rows.as_slice(), false, wk);
        let a = dy * self.weight.to_kind(wk);
        let dot = (&a * &xn).mean_dim(-1, true, wk);
        ((a - xn * dot) * r, dw)
    }

    /// The norm of x [B, L, H, D] (per head), then RoPE with `cos` / signed sin [B, 1, L, D] (as
    /// [`rope_cos_sin`] makes them), outside autograd: [B, L, H, D]. One kernel on a GPU
    /// (`kernels::norm_rope`), the ops of [`forward`](Self::forward) and [`apply_rope`] elsewhere.
    pub fn forward_rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        static FAILED: AtomicBool = AtomicBool::new(false);
        let kernel = || kernels::norm_rope::forward(x, &self.weight, self.eps, cos, sin);
        let fused = kernels::norm_rope::applies(x, cos)
            .then(|| kernels::nvrtc::try_kernel(&FAILED, "the q/k norm + RoPE kernel", kernel));
        fused.flatten().unwrap_or_else(|| apply_rope(&self.forward(x).transpose(1, 2), cos, sin).transpose(1, 2))
    }

    /// [`forward_rope`](Self::forward_rope)'s backward from dy = dLoss/dy [B, L, H, D]: dLoss/dx
    /// and dLoss/d(weight) (in the weight's kind). With g = dLoss/d(w * xn), the rotation
    /// transposed, g = dy cos + swap(dy ssin) (swap([a, b]) = [b, a]); dw = sum g xn; dx = r (g w -
    /// xn mean(g w xn)), r = 1 / rms(x), xn = x r.
    pub fn backward_rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, dy: &Tensor) -> (Tensor, Tensor) {
        static FAILED: AtomicBool = AtomicBool::new(false);
        let kernel = || kernels::norm_rope::backward(x, &self.weight, self.eps, cos, sin, dy);
        let fused = kernels::norm_rope::applies(x, cos)
            .then(|| kernels::nvrtc::try_kernel(&FAILED, "the q/k norm + RoPE kernel", kernel));
        let (dx, dw) = fused.flatten().unwrap_or_else(|| {
            let wk = work_kind(x);
            let (c, s, dy) = (cos.transpose(1, 2).to_kind(wk), sin.transpose(1, 2).to_kind(wk), dy.to_kind(wk)); // [B, L, 1, D]
            let g = &dy * c + swap_halves(&(&dy * s));
            self.composite_backward(x, &g)
        });
        (dx.to_kind(x.kind()), dw.to_kind(self.weight.kind()))
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }
}

/// The kind the norms' composite backward computes in: fp64 for fp64 input, else fp32.
fn work_kind(x: &Tensor) -> Kind {
    if x.kind() == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// [a, b] -> [b, a] over the last dim's halves.
fn swap_halves(x: &Tensor) -> Tensor {
    let half = *x.size().last().expect("a last dim") / 2;
    Tensor::cat(&[x.narrow(-1, half, half), x.narrow(-1, 0, half)], -1)
}

/// HF's default `initializer_range`.
pub const INITIALIZER_RANGE: f64 = 0.02;

/// A bias-free linear layer, weights drawn with std `initializer_range` (HF's init).
pub fn linear(p: &nn::Path, name: &str, in_dim: usize, out_dim: usize, initializer_range: f64) -> nn::Linear {
    let cfg = nn::LinearConfig {
        ws_init: nn::Init::Randn { mean: 0.0, stdev: initializer_range },
        bs_init: None,
        bias: false,
    };
    nn::linear(p / name, in_dim as i64, out_dim as i64, cfg)
}

/// A bias-free `lin` of the context [B, S, H] and block [B, N, H] rows as one [B, S+N, out]
/// tensor, each part's batched GEMM writing its own rows of it (a `cat` of the two outputs would
/// copy both once more). Outside autograd (an `out=` op).
fn project_into_one(lin: &nn::Linear, ctx: &Tensor, x: &Tensor) -> Tensor {
    debug_assert!(lin.bs.is_none(), "the drafter's projections have no bias");
    let (b, s, n) = (x.size()[0], ctx.size()[1], x.size()[1]);
    let w_t = lin.ws.tr(); // [H, out]
    let out = Tensor::empty([b, s + n, w_t.size()[1]], (x.kind(), x.device()));
    let w_t = w_t.unsqueeze(0).expand([b, -1, -1], false);
    for (rows, from, len) in [(ctx, 0, s), (x, s, n)] {
        let _ = rows.bmm_out(&out.narrow(1, from, len), &w_t);
    }
    out
}

/// Rotary embedding tables for integer positions [B, L] -> (cos, signed sin) [B, 1, L, D]; the
/// sine's first half is negated so that [`apply_rope`] needs no negation pass. A RoPE scaling
/// changes the frequencies and may scale cos and sin (YaRN's attention factor).
pub fn rope_cos_sin(
    positions: &Tensor,
    head_dim: usize,
    theta: f64,
    scaling: &RopeScaling,
    kind: Kind,
) -> (Tensor, Tensor) {
    let d = head_dim as i64;
    let device = positions.device();
    let (inv_freq, attention) = match scaling {
        RopeScaling::Default => {
            ((Tensor::arange_start_step(0, d, 2, (Kind::Float, device)) / d as f64 * -theta.ln()).exp(), 1.0)
        }
        scaled => {
            let (freqs, attention) = scaled.inv_freq(head_dim, theta);
            (Tensor::from_slice(&freqs).to_kind(Kind::Float).to_device(device), attention)
        }
    };
    let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * inv_freq; // [B, L, D/2]
    let mut cos = Tensor::cat(&[&freqs, &freqs], -1).cos().unsqueeze(1); // [B, 1, L, D]
    let mut sin = freqs.sin();
    if attention != 1.0 {
        cos = cos * attention;
        sin = sin * attention;
    }
    let signed_sin = Tensor::cat(&[&(-&sin), &sin], -1).unsqueeze(1);
    (cos.to_kind(kind), signed_sin.to_kind(kind))
}

/// x * cos + rotate_half(x) * sin with rotate_half([a, b]) = [-b, a], as x * cos + [b, a] *
/// signed_sin: three passes (swap, scale, fused multiply-add) where the textbook form takes five.
pub fn apply_rope(x: &Tensor, cos: &Tensor, signed_sin: &Tensor) -> Tensor {
    (x * cos).addcmul(&swap_halves(x), signed_sin)
}

/// What every attention layer of one forward shares: RoPE tables (cos and signed sin, as
/// [`rope_cos_sin`] makes them) for queries (blocks) and keys ([context; blocks]), and, for
/// masked attention, the visibility masks [B, 1, N, S+N] of full and sliding-window layers.
pub struct AttentionInputs {
    pub q_cos: Tensor,
    pub q_sin: Tensor,
    pub k_cos: Tensor,
    pub k_sin: Tensor,
    /// None when the layers use split attention (kernels::block_attention), which takes a bias.
    pub mask: Option<Tensor>,
    /// The sliding-window layers' mask and window (masked attention with such layers only).
    pub sliding: Option<(i64, Tensor)>,
}

impl AttentionInputs {
    /// anchors [B, A]; the context has `s` positions; blocks of `bk` tokens; `window`: the
    /// sliding window of the drafter's sliding-window layers, if it has any.
    pub fn new(
        anchors: &Tensor,
        s: i64,
        bk: i64,
        cfg: &DenseShape,
        kind: Kind,
        masked: bool,
        window: Option<i64>,
    ) -> Self {
        let (b, a) = (anchors.size()[0], anchors.size()[1]);
        let device = anchors.device();
        // Positions: block token k of anchor a sits at a + k; the context at 0..S-1.
        let block_pos = (anchors.unsqueeze(-1) + Tensor::arange(bk, (Kind::Int64, device))).view([b, a * bk]);
        let ctx_pos = Tensor::arange(s, (Kind::Int64, device)).unsqueeze(0).expand([b, s], false);
        let (q_cos, q_sin) = rope_cos_sin(&block_pos, cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling, kind);
        let k_pos = Tensor::cat(&[&ctx_pos, &block_pos], 1);
        let (k_cos, k_sin) = rope_cos_sin(&k_pos, cfg.head_dim, cfg.rope_theta, &cfg.rope_scaling, kind);
        let mask = masked.then(|| kernels::block_attention::masked_sdpa_mask(anchors, s, bk, None));
        let sliding =
            window.filter(|_| masked).map(|w| (w, kernels::block_attention::masked_sdpa_mask(anchors, s, bk, Some(w))));
        Self { q_cos, q_sin, k_cos, k_sin, mask, sliding }
    }

    /// The masked-attention mask of a layer with sliding window `window` (None: full attention).
    fn mask_for(&self, window: Option<i64>) -> &Tensor {
        match window {
            None => self.mask.as_ref().expect("masked attention: AttentionInputs built with the mask"),
            Some(w) => match &self.sliding {
                Some((sw, m)) if *sw == w => m,
                _ => panic!("masked attention: AttentionInputs built without the window-{w} mask"),
            },
        }
    }
}

/// DFlash block attention: Q from the block tokens, K/V from [context; block] with this layer's
/// projections (Qwen3 attention with q/k norm, GQA).
#[derive(Debug)]
pub struct Attention {
    q_proj: nn::Linear,
    k_proj: nn::Linear,
    v_proj: nn::Linear,
    o_proj: nn::Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
    /// HF's `sliding_window` for a `sliding_attention` layer (None: full attention).
    pub window: Option<i64>,
}

impl Attention {
    pub fn new(p: nn::Path, cfg: &DenseShape, window: Option<i64>) -> Self {
        let (h, d, std) = (cfg.hidden_size, cfg.head_dim, cfg.initializer_range);
        Self {
            q_proj: linear(&p, "q_proj", h, cfg.num_attention_heads * d, std),
            k_proj: linear(&p, "k_proj", h, cfg.num_key_value_heads * d, std),
            v_proj: linear(&p, "v_proj", h, cfg.num_key_value_heads * d, std),
            o_proj: linear(&p, "o_proj", cfg.num_attention_heads * d, h, std),
            q_norm: RmsNorm::new(&p / "q_norm", d as i64, cfg.rms_norm_eps),
            k_norm: RmsNorm::new(&p / "k_norm", d as i64, cfg.rms_norm_eps),
            num_heads: cfg.num_attention_heads as i64,
            num_kv_heads: cfg.num_key_value_heads as i64,
            head_dim: d as i64,
            window,
        }
    }

    /// x: block tokens [B, N, H] (input-normed); ctx: fused context [B, S, H].
    pub fn forward(&self, x: &Tensor, ctx: &Tensor, at: &AttentionInputs) -> Tensor {
        let (q, k, v) = self.project(x, ctx, at);
        // Sparse block attention, GQA by head groups.
        let mask = at.mask_for(self.window);
        let o = Tensor::scaled_dot_product_attention(&q, &k, &v, Some(mask), 0.0, false, Some(self.scale()), true);
        self.output(&o)
    }

    /// Q from the block only [B, nh, N, D]; K/V from [context; block] [B, nkv, S+N, D]; RoPE at
    /// anchor + k for blocks, 0..S-1 for the context.
    pub fn project(&self, x: &Tensor, ctx: &Tensor, at: &AttentionInputs) -> (Tensor, Tensor, Tensor) {
        let (q, k, v) = self.projections(x, ctx, |lin| Tensor::cat(&[lin.forward(ctx), lin.forward(x)], 1));
        let q = self.q_norm.forward(&q).transpose(1, 2);
        let k = self.k_norm.forward(&k).transpose(1, 2);
        (apply_rope(&q, &at.q_cos, &at.q_sin), apply_rope(&k, &at.k_cos, &at.k_sin), v)
    }

    /// The q projection of the block [B, N, nh, D], and the k [B, S+N, nkv, D] and v [B, nkv,
    /// S+N, D] projections of [context; block] (`both` gives a projection's [B, S+N, kv] rows):
    /// before the norms and RoPE.
    fn projections(&self, x: &Tensor, ctx: &Tensor, both: impl Fn(&nn::Linear) -> Tensor) -> (Tensor, Tensor, Tensor) {
        let (b, n, s) = (x.size()[0], x.size()[1], ctx.size()[1]);
        let q = self.q_proj.forward(x).view([b, n, self.num_heads, self.head_dim]);
        let k = both(&self.k_proj).view([b, s + n, self.num_kv_heads, self.head_dim]);
        let v = both(&self.v_proj).view([b, s + n, self.num_kv_heads, self.head_dim]).transpose(1, 2);
        (q, k, v)
    }

    /// [`project`](Self::project) for a drafter running its own backward, outside autograd (the q
    /// and k norms and RoPE one kernel each on a GPU); [`cut_grads`](Self::cut_grads) writes the
    /// backward out, down to x.
    pub fn project_cut(&self, x: &Tensor, ctx: &Tensor, at: &AttentionInputs) -> (Tensor, Tensor, Tensor, ProjCut) {
        no_grad(|| {
            let (q_lin, k_lin, v) = self.projections(x, ctx, |lin| project_into_one(lin, ctx, x));
            let q = self.q_norm.forward_rope(&q_lin, &at.q_cos, &at.q_sin);
            let k = self.k_norm.forward_rope(&k_lin, &at.k_cos, &at.k_sin);
            (q.transpose(1, 2), k.transpose(1, 2), v, ProjCut { x: x.shallow_clone(), q_lin, k_lin })
        })
    }

    /// [`project_cut`](Self::project_cut)'s backward, given dq [B, nh, N, D] and dk, dv [B, nkv,
    /// S+N, D]: dLoss/dx, and (weight, gradient) pairs for the five weights; the context's
    /// gradient is added into `d_ctx` [B, S, H]. Each GEMM into x's and the context's gradients
    /// accumulates onto the one before: a separate sum would cost two more passes over them each
    /// time.
    // The three incoming gradients and the one accumulated into are the backward's inputs as
    // the forward made them; a struct built for this one call would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub fn cut_grads(
        &self,
        cut: &ProjCut,
        at: &AttentionInputs,
        ctx: &Tensor,
        dq: &Tensor,
        dk: &Tensor,
        dv: &Tensor,
        d_ctx: &mut Tensor,
    ) -> (Tensor, [(Tensor, Tensor); 5]) {
        no_grad(|| {
            let (b, n, h) = (cut.x.size()[0], cut.x.size()[1], cut.x.size()[2]);
            let (s, kv) = (ctx.size()[1], self.num_kv_heads * self.head_dim);
            let (d_q_lin, d_q_norm) = self.q_norm.backward_rope(&cut.q_lin, &at.q_cos, &at.q_sin, &dq.transpose(1, 2));
            let (d_k_lin, d_k_norm) = self.k_norm.backward_rope(&cut.k_lin, &at.k_cos, &at.k_sin, &dk.transpose(1, 2));
            let d_q = d_q_lin.reshape([b * n, -1]);
            let dx = d_q.mm(&self.q_proj.ws);
            let d_wq = d_q.tr().mm(&cut.x.reshape([b * n, h]));
            // k and v read [context; block] of each sequence: their rows of each part are dense.
            let kv_grads = |d: Tensor, w: &Tensor| {
                let d = d.reshape([b, s + n, kv]);
                let mut dw = w.zeros_like();
                for i in 0..b {
                    let (d_context, d_block) = (d.get(i).narrow(0, 0, s), d.get(i).narrow(0, s, n));
                    let _ = dx.narrow(0, i * n, n).addmm_(&d_block, w);
                    let _ = d_ctx.get(i).addmm_(&d_context, w);
                    let _ = dw.addmm_(&d_context.tr(), &ctx.get(i)).addmm_(&d_block.tr(), &cut.x.get(i));
                }
                dw
            };
            let d_wk = kv_grads(d_k_lin, &self.k_proj.ws);
            let d_wv = kv_grads(dv.transpose(1, 2), &self.v_proj.ws);
            let weights = [
                (self.q_proj.ws.shallow_clone(), d_wq),
                (self.k_proj.ws.shallow_clone(), d_wk),
                (self.v_proj.ws.shallow_clone(), d_wv),
                (self.q_norm.weight().shallow_clone(), d_q_norm),
                (self.k_norm.weight().shallow_clone(), d_k_norm),
            ];
            (dx.view_as(&cut.x), weights)
        })
    }

    /// Decoding: keys (RoPE'd with `cos`/`sin` at their positions) and values [B, nkv, n, D] of
    /// `rows` [B, n, H]: the fused context's, kept between draft cycles, or the block's own.
    pub fn keys_values(&self, rows: &Tensor, cos: &Tensor, sin: &Tensor) -> (Tensor, Tensor) {
        let (b, n) = (rows.size()[0], rows.size()[1]);
        let k = self.k_proj.forward(rows).view([b, n, self.num_kv_heads, self.head_dim]);
        let k = self.k_norm.forward(&k).transpose(1, 2);
        let v = self.v_proj.forward(rows).view([b, n, self.num_kv_heads, self.head_dim]).transpose(1, 2);
        (apply_rope(&k, cos, sin), v)
    }

    /// Decoding: one block x [B, Bk, H] (input-normed) at the positions of `cos`/`sin`, against
    /// the kept context keys/values and its own; `mask` [B, 1, Bk, S+Bk], or None where the
    /// block sees all of both (a full-attention layer: the context is exactly what lies before
    /// the anchor). Equals [`forward`](Self::forward) over the whole context.
    pub fn forward_decode(
        &self,
        x: &Tensor,
        context: &(Tensor, Tensor),
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
    ) -> Tensor {
        let (b, n) = (x.size()[0], x.size()[1]);
        let q = self.q_proj.forward(x).view([b, n, self.num_heads, self.head_dim]);
        let q = apply_rope(&self.q_norm.forward(&q).transpose(1, 2), cos, sin);
        let (k, v) = self.keys_values(x, cos, sin);
        let k = Tensor::cat(&[&context.0, &k], 2);
        let v = Tensor::cat(&[&context.1, &v], 2);
        let o = kernels::sdpa::grouped(&q, &k, &v, mask, false, self.scale());
        self.output(&o)
    }

    /// The attention output [B, nh, N, D] back to the hidden size.
    pub fn output(&self, o: &Tensor) -> Tensor {
        self.output_merged(&self.heads_merged(o))
    }

    /// [`output`](Self::output) of the attention output as [`heads_merged`](Self::heads_merged)
    /// gives it.
    pub fn output_merged(&self, merged: &Tensor) -> Tensor {
        self.o_proj.forward(merged)
    }

    /// The attention output [B, nh, N, D] as the output projection reads it: [B, N, nh D].
    pub fn heads_merged(&self, o: &Tensor) -> Tensor {
        let (b, n) = (o.size()[0], o.size()[2]);
        o.transpose(1, 2).reshape([b, n, self.num_heads * self.head_dim])
    }

    /// The output projection's backward, outside autograd, from its input `merged` ([B, N, nh D],
    /// [`heads_merged`](Self::heads_merged)) and dy = dLoss/d(output) [B, N, H]: (dLoss/do
    /// [B, nh, N, D], the weight's gradient pair).
    pub fn output_grads(&self, merged: &Tensor, dy: &Tensor) -> (Tensor, (Tensor, Tensor)) {
        no_grad(|| {
            let (b, n, f) = (merged.size()[0], merged.size()[1], merged.size()[2]);
            let dy = dy.reshape([b * n, -1]);
            let d_merged = dy.mm(&self.o_proj.ws).view([b, n, self.num_heads, self.head_dim]).transpose(1, 2);
            let d_w = dy.tr().mm(&merged.reshape([b * n, f]));
            (d_merged, (self.o_proj.ws.shallow_clone(), d_w))
        })
    }

    pub fn scale(&self) -> f64 {
        (self.head_dim as f64).powf(-0.5)
    }
}

/// SwiGLU MLP.
#[derive(Debug)]
pub struct Mlp {
    gate_proj: nn::Linear,
    up_proj: nn::Linear,
    down_proj: nn::Linear,
}

impl Mlp {
    pub fn new(p: nn::Path, cfg: &DenseShape) -> Self {
        let (h, f, std) = (cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range);
        Self {
            gate_proj: linear(&p, "gate_proj", h, f, std),
            up_proj: linear(&p, "up_proj", h, f, std),
            down_proj: linear(&p, "down_proj", f, h, std),
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        self.down_proj.forward(&(self.gate_proj.forward(x).silu() * self.up_proj.forward(x)))
    }

    /// `forward` for a drafter running its own backward, outside autograd;
    /// [`cut_grads`](Self::cut_grads) writes the backward out, down to x. Autograd would also keep
    /// silu(gate) and the product for it: two more [tokens, ffn] tensors a layer (0.8 GB each at
    /// the bench shapes), recomputed here from gate and up instead. On a GPU the product and its
    /// backward are one kernel each (`kernels::swiglu`).
    pub fn forward_cut(&self, x: &Tensor) -> (Tensor, MlpCut) {
        no_grad(|| {
            let gate = self.gate_proj.forward(x);
            let up = self.up_proj.forward(x);
            let y = kernels::swiglu::forward(&gate, &up).matmul(&self.down_proj.ws.tr());
            (y, MlpCut { x: x.shallow_clone(), gate, up })
        })
    }

    /// The cut MLP's backward from dy = dLoss/d(output): dLoss/dx, and (weight, gradient) pairs
    /// for the three weights. x's gradient through the up projection accumulates onto the gate's
    /// in its GEMM.
    pub fn cut_grads(&self, cut: &MlpCut, dy: &Tensor) -> (Tensor, [(Tensor, Tensor); 3]) {
        no_grad(|| {
            let (wg, wu, wd) = (&self.gate_proj.ws, &self.up_proj.ws, &self.down_proj.ws);
            let rows = |t: &Tensor| t.reshape([-1, *t.size().last().expect("a last dim")]);
            let (h, d_gate, d_up) = kernels::swiglu::backward(&cut.gate, &cut.up, &dy.matmul(wd));
            let (x, dy, h, d_gate, d_up) = (rows(&cut.x), rows(dy), rows(&h), rows(&d_gate), rows(&d_up));
            let mut dx = d_gate.mm(wg);
            let _ = dx.addmm_(&d_up, wu);
            let weights = [
                (wg.shallow_clone(), d_gate.tr().mm(&x)),
                (wu.shallow_clone(), d_up.tr().mm(&x)),
                (wd.shallow_clone(), dy.tr().mm(&h)),
            ];
            (dx.view_as(&cut.x), weights)
        })
    }
}

/// What [`Attention::cut_grads`] takes: the projections' input and the q and k projections
/// [B, L, heads, D] before their norm and RoPE.
pub struct ProjCut {
    x: Tensor,
    q_lin: Tensor,
    k_lin: Tensor,
}

/// What [`Mlp::cut_grads`] takes: the MLP's input and its gate and up projections.
pub struct MlpCut {
    x: Tensor,
    gate: Tensor,
    up: Tensor,
}
