//! The DFlash drafter (DFLASH.md; z-lab `dflash/model.py` for the layer order): target features
//! fused by `fc` + `hidden_norm`, then Qwen3 decoder layers whose attention takes Q from the block
//! tokens and K/V from [context; block], each block seeing the context strictly before its anchor
//! and itself. Weight names equal the z-lab checkpoint's. The layers are `drafter_layers`'.

use crate::config::DFlashConfig;
use drafter_layers::layers::{linear, Attention, AttentionInputs, Mlp, RmsNorm};
use plugin_api::tch::{nn, nn::Module, Device, Kind, Tensor};

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
        let s = target_hidden.size()[1];
        let bk = self.cfg.block_size as i64;

        // 1. Fuse the target features: [B, S, n*H] -> [B, S, H].
        let ctx = self.hidden_norm.forward(&self.fc.forward(target_hidden));

        // 2. RoPE positions (block token k of anchor a at a + k, the context at 0..S-1) and the
        //    mask: context keys strictly before the query's anchor, the query's own block.
        let at = AttentionInputs::new(anchors, s, bk, &self.cfg.dense_shape(), block_embeds.kind());

        // 3. Decoder layers over the block tokens, then the final norm.
        let mut x = block_embeds.shallow_clone();
        for layer in &self.layers {
            x = layer.forward(&x, &ctx, &at);
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
