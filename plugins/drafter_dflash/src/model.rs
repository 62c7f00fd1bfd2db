//! The DFlash drafter (DFLASH.md; z-lab `dflash/model.py` for the layer order): target features
//! fused by `fc` + `hidden_norm`, then Qwen3 decoder layers whose attention takes Q from the block
//! tokens and K/V from [context; block], each block seeing the context strictly before its anchor
//! and itself. Weight names equal the z-lab checkpoint's.

use crate::config::DFlashConfig;
use plugin_api::tch::{nn, nn::Module, Device, Kind, Tensor};

/// RMSNorm over the last dim, computed in fp32 (Qwen3RMSNorm).
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
        let kind = x.kind();
        let x = x.to_kind(Kind::Float);
        let var = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
        (x * (var + self.eps).rsqrt()).to_kind(kind) * &self.weight
    }
}

fn linear(p: &nn::Path, name: &str, in_dim: usize, out_dim: usize) -> nn::Linear {
    // HF's initializer_range 0.02, no biases (z-lab drafters have none).
    let cfg = nn::LinearConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: 0.02 }, bs_init: None, bias: false };
    nn::linear(p / name, in_dim as i64, out_dim as i64, cfg)
}

/// Rotary embedding tables for integer positions [B, L] -> (cos, sin) [B, 1, L, D].
pub fn rope_cos_sin(positions: &Tensor, head_dim: usize, theta: f64, kind: Kind) -> (Tensor, Tensor) {
    let d = head_dim as i64;
    let device = positions.device();
    let inv_freq = (Tensor::arange_start_step(0, d, 2, (Kind::Float, device)) / d as f64 * -theta.ln()).exp();
    let freqs = positions.to_kind(Kind::Float).unsqueeze(-1) * inv_freq; // [B, L, D/2]
    let emb = Tensor::cat(&[&freqs, &freqs], -1).unsqueeze(1); // [B, 1, L, D]
    (emb.cos().to_kind(kind), emb.sin().to_kind(kind))
}

/// x * cos + rotate_half(x) * sin, rotate_half([a, b]) = [-b, a].
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    let a = x.narrow(3, 0, half);
    let b = x.narrow(3, half, half);
    let rotated = Tensor::cat(&[&(-b), &a], 3);
    x * cos + rotated * sin
}

#[derive(Debug)]
struct Attention {
    q_proj: nn::Linear,
    k_proj: nn::Linear,
    v_proj: nn::Linear,
    o_proj: nn::Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    num_heads: i64,
    num_kv_heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(p: nn::Path, cfg: &DFlashConfig) -> Self {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        Self {
            q_proj: linear(&p, "q_proj", h, cfg.num_attention_heads * d),
            k_proj: linear(&p, "k_proj", h, cfg.num_key_value_heads * d),
            v_proj: linear(&p, "v_proj", h, cfg.num_key_value_heads * d),
            o_proj: linear(&p, "o_proj", cfg.num_attention_heads * d, h),
            q_norm: RmsNorm::new(&p / "q_norm", d as i64, cfg.rms_norm_eps),
            k_norm: RmsNorm::new(&p / "k_norm", d as i64, cfg.rms_norm_eps),
            num_heads: cfg.num_attention_heads as i64,
            num_kv_heads: cfg.num_key_value_heads as i64,
            head_dim: d as i64,
        }
    }

    /// x: block tokens [B, N, H] (already input-normed); ctx: fused context [B, S, H].
    fn forward(&self, x: &Tensor, ctx: &Tensor, rope: &Rope, mask: &Tensor) -> Tensor {
        let (b, n) = (x.size()[0], x.size()[1]);
        let s = ctx.size()[1];
        // 1. Q from the block only; K/V from [context; block] with this layer's projections.
        let q = self.q_proj.forward(x).view([b, n, self.num_heads, self.head_dim]);
        let q = self.q_norm.forward(&q).transpose(1, 2); // [B, nh, N, D]
        let k = Tensor::cat(&[self.k_proj.forward(ctx), self.k_proj.forward(x)], 1)
            .view([b, s + n, self.num_kv_heads, self.head_dim]);
        let k = self.k_norm.forward(&k).transpose(1, 2); // [B, nkv, S+N, D]
        let v = Tensor::cat(&[self.v_proj.forward(ctx), self.v_proj.forward(x)], 1)
            .view([b, s + n, self.num_kv_heads, self.head_dim])
            .transpose(1, 2);
        // 2. RoPE: block tokens at anchor + k, context at 0..S-1.
        let q = apply_rope(&q, &rope.q_cos, &rope.q_sin);
        let k = apply_rope(&k, &rope.k_cos, &rope.k_sin);
        // 3. Sparse block attention as a boolean mask (true = visible), GQA by head groups.
        let o = Tensor::scaled_dot_product_attention(
            &q,
            &k,
            &v,
            Some(mask),
            0.0,
            false,
            Some((self.head_dim as f64).powf(-0.5)),
            true,
        );
        self.o_proj.forward(&o.transpose(1, 2).reshape([b, n, self.num_heads * self.head_dim]))
    }
}

#[derive(Debug)]
struct Mlp {
    gate_proj: nn::Linear,
    up_proj: nn::Linear,
    down_proj: nn::Linear,
}

impl Mlp {
    fn new(p: nn::Path, cfg: &DFlashConfig) -> Self {
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        Self {
            gate_proj: linear(&p, "gate_proj", h, f),
            up_proj: linear(&p, "up_proj", h, f),
            down_proj: linear(&p, "down_proj", f, h),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        self.down_proj.forward(&(self.gate_proj.forward(x).silu() * self.up_proj.forward(x)))
    }
}

#[derive(Debug)]
struct DecoderLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    fn new(p: nn::Path, cfg: &DFlashConfig) -> Self {
        let h = cfg.hidden_size as i64;
        Self {
            self_attn: Attention::new(&p / "self_attn", cfg),
            mlp: Mlp::new(&p / "mlp", cfg),
            input_layernorm: RmsNorm::new(&p / "input_layernorm", h, cfg.rms_norm_eps),
            post_attention_layernorm: RmsNorm::new(&p / "post_attention_layernorm", h, cfg.rms_norm_eps),
        }
    }

    fn forward(&self, x: &Tensor, ctx: &Tensor, rope: &Rope, mask: &Tensor) -> Tensor {
        // The context enters K/V as fused (hidden_norm'd), not through input_layernorm.
        let x = x + self.self_attn.forward(&self.input_layernorm.forward(x), ctx, rope, mask);
        &x + self.mlp.forward(&self.post_attention_layernorm.forward(&x))
    }
}

/// RoPE tables for one forward: queries (blocks) and keys ([context; blocks]).
struct Rope {
    q_cos: Tensor,
    q_sin: Tensor,
    k_cos: Tensor,
    k_sin: Tensor,
}

#[derive(Debug)]
pub struct DFlashDrafter {
    pub cfg: DFlashConfig,
    fc: nn::Linear,
    hidden_norm: RmsNorm,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
}

impl DFlashDrafter {
    pub fn new(root: &nn::Path, cfg: &DFlashConfig) -> Self {
        let h = cfg.hidden_size;
        let n_feat = cfg.dflash_config.target_layer_ids.len();
        Self {
            cfg: cfg.clone(),
            fc: linear(root, "fc", n_feat * h, h),
            hidden_norm: RmsNorm::new(root / "hidden_norm", h as i64, cfg.rms_norm_eps),
            layers: (0..cfg.num_hidden_layers).map(|i| DecoderLayer::new(root / "layers" / i, cfg)).collect(),
            norm: RmsNorm::new(root / "norm", h as i64, cfg.rms_norm_eps),
        }
    }

    /// target_hidden [B, S, n*H], block_embeds [B, A*Bk, H], anchors [B, A] (int64)
    /// -> block hidden states [B, A*Bk, H] after the final norm.
    pub fn forward(&self, target_hidden: &Tensor, block_embeds: &Tensor, anchors: &Tensor) -> Tensor {
        let (b, s) = (target_hidden.size()[0], target_hidden.size()[1]);
        let a = anchors.size()[1];
        let bk = self.cfg.block_size as i64;
        let n = a * bk;
        let device = target_hidden.device();
        let kind = block_embeds.kind();

        // 1. Fuse the target features: [B, S, n*H] -> [B, S, H].
        let ctx = self.hidden_norm.forward(&self.fc.forward(target_hidden));

        // 2. Positions: block token k of anchor a sits at a + k; the context at 0..S-1.
        let offsets = Tensor::arange(bk, (Kind::Int64, device));
        let block_pos = (anchors.unsqueeze(-1) + offsets).view([b, n]);
        let ctx_pos = Tensor::arange(s, (Kind::Int64, device)).unsqueeze(0).expand([b, s], false);
        let (q_cos, q_sin) = rope_cos_sin(&block_pos, self.cfg.head_dim, self.cfg.rope_theta, kind);
        let (k_cos, k_sin) =
            rope_cos_sin(&Tensor::cat(&[&ctx_pos, &block_pos], 1), self.cfg.head_dim, self.cfg.rope_theta, kind);
        let rope = Rope { q_cos, q_sin, k_cos, k_sin };

        // 3. Mask [B, 1, N, S+N]: context keys strictly before the query's anchor, and the keys
        //    of the query's own block; never another block.
        let anchor_of_query = anchors.repeat_interleave_self_int(bk, Some(1), None::<i64>); // [B, N]
        let ctx_visible = Tensor::arange(s, (Kind::Int64, device))
            .view([1, 1, s])
            .lt_tensor(&anchor_of_query.unsqueeze(-1)); // [B, N, S]
        let block_id = Tensor::arange(n, (Kind::Int64, device)).divide_scalar_mode(bk, "floor");
        let same_block = block_id.unsqueeze(1).eq_tensor(&block_id.unsqueeze(0)).unsqueeze(0).expand([b, n, n], false);
        let mask = Tensor::cat(&[ctx_visible, same_block], 2).unsqueeze(1);

        // 4. Decoder layers over the block tokens, then the final norm.
        let mut x = block_embeds.shallow_clone();
        for layer in &self.layers {
            x = layer.forward(&x, &ctx, &rope, &mask);
        }
        self.norm.forward(&x)
    }
}

/// Build on `device` with weights of `kind`.
pub fn build(cfg: &DFlashConfig, device: Device, kind: Kind) -> (nn::VarStore, DFlashDrafter) {
    let mut vs = nn::VarStore::new(device);
    let model = DFlashDrafter::new(&vs.root(), cfg);
    if kind != Kind::Float {
        vs.set_kind(kind);
    }
    (vs, model)
}
