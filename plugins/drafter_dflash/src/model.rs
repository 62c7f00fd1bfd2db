//! The DFlash drafter (DFLASH.md; z-lab `dflash/model.py` for the layer order): target features
//! fused by `fc` + `hidden_norm`, then Qwen3 decoder layers whose attention takes Q from the block
//! tokens and K/V from [context; block], each block seeing the context strictly before its anchor
//! and itself. Weight names equal the z-lab checkpoint's. The layers are `drafter_layers`'.

use crate::config::DFlashConfig;
use drafter_layers::layers::{linear, Attention, AttentionInputs, Mlp, RmsNorm};
use plugin_api::tch::{self as tch, nn, nn::Module, Device, Kind, Tensor};

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
            self_attn: Attention::new(&p / "self_attn", &cfg.dense_shape()),
            mlp: Mlp::new(&p / "mlp", &cfg.dense_shape()),
            input_layernorm: RmsNorm::new(&p / "input_layernorm", h, cfg.rms_norm_eps),
            post_attention_layernorm: RmsNorm::new(&p / "post_attention_layernorm", h, cfg.rms_norm_eps),
        }
    }

    fn forward(&self, x: &Tensor, ctx: &Tensor, at: &AttentionInputs) -> Tensor {
        // The context enters K/V as fused (hidden_norm'd), not through input_layernorm.
        let x = x + self.self_attn.forward(&self.input_layernorm.forward(x), ctx, at);
        &x + self.mlp.forward(&self.post_attention_layernorm.forward(&x))
    }
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
        let (ctx, at) = self.context(target_hidden, block_embeds, anchors);
        let mut x = block_embeds.shallow_clone();
        for layer in &self.layers {
            x = layer.forward(&x, &ctx, &at);
        }
        self.norm.forward(&x)
    }

    /// 1. The target features fused: [B, S, n*H] -> [B, S, H]. 2. RoPE positions (block token k
    /// of anchor a at a + k, the context at 0..S-1) and the mask: context keys strictly before
    /// the query's anchor, the query's own block.
    fn context(&self, target_hidden: &Tensor, block_embeds: &Tensor, anchors: &Tensor) -> (Tensor, AttentionInputs) {
        let ctx = self.hidden_norm.forward(&self.fc.forward(target_hidden));
        let (s, bk) = (target_hidden.size()[1], self.cfg.block_size as i64);
        (ctx, AttentionInputs::new(anchors, s, bk, &self.cfg.dense_shape(), block_embeds.kind()))
    }

    /// `forward` keeping only each layer's input: the output is a leaf, and
    /// [`backward`](Self::backward) recomputes one layer at a time. Saved activations drop
    /// from all layers' to one layer's, for one more forward pass of the layers.
    pub fn forward_checkpointed(&self, target_hidden: &Tensor, block_embeds: &Tensor, anchors: &Tensor) -> (Tensor, Checkpoints) {
        let (ctx, at) = self.context(target_hidden, block_embeds, anchors);
        // A leaf for the layers: their gradients w.r.t. the context add up in it.
        let ctx_leaf = ctx.detach().set_requires_grad(true);
        let mut inputs = Vec::with_capacity(self.layers.len());
        let mut x = block_embeds.shallow_clone();
        tch::no_grad(|| {
            for layer in &self.layers {
                inputs.push(x.shallow_clone());
                x = layer.forward(&x, &ctx_leaf, &at);
            }
        });
        let last = x.set_requires_grad(true);
        let out = self.norm.forward(&last);
        let leaf = out.detach().set_requires_grad(true);
        (leaf, Checkpoints { ctx, ctx_leaf, at, inputs, last, out })
    }

    /// Gradients from `grad` = dLoss/d(output) into the parameters, last layer first.
    pub fn backward(&self, ck: Checkpoints, grad: &Tensor) {
        // (y * g).sum() has gradient g w.r.t. y: tch's backward takes no output gradient.
        let pull = |y: &Tensor, g: &Tensor| (y * g).sum(Kind::Float).backward();
        pull(&ck.out, grad);
        let mut g = ck.last.grad();
        for (i, (layer, x)) in self.layers.iter().zip(ck.inputs).enumerate().rev() {
            // The first layer's input is the frozen embedding: no gradient wanted.
            let x = x.set_requires_grad(i > 0);
            pull(&layer.forward(&x, &ck.ctx_leaf, &ck.at), &g);
            if i > 0 {
                g = x.grad();
            }
        }
        pull(&ck.ctx, &ck.ctx_leaf.grad());
    }
}

/// What [`DFlashDrafter::forward_checkpointed`] keeps for the backward.
pub struct Checkpoints {
    /// The fused context with its graph (fc, hidden_norm), and the leaf the layers read.
    ctx: Tensor,
    ctx_leaf: Tensor,
    at: AttentionInputs,
    /// Each layer's input, no graph.
    inputs: Vec<Tensor>,
    /// The last layer's output as a leaf, and the final norm of it.
    last: Tensor,
    out: Tensor,
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
