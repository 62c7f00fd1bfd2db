//! The hybrid DFlash drafter: target features fused by `fc` + `hidden_norm` (as the dense
//! drafter), then decoder layers whose mixer is a Gated DeltaNet (`linear_attn`) or DFlash's dense
//! block attention (`self_attn`), each followed by a SwiGLU MLP, then the final norm. Every layer
//! reads the same fused context; only block tokens flow from layer to layer.

use crate::config::{GdnConfig, LayerType};
use crate::gdn::GatedDeltaNet;
use drafter_layers::layers::{linear, Attention, AttentionInputs, Mlp, RmsNorm};
use plugin_api::tch::{nn, nn::Module, Device, Kind, Tensor};

#[derive(Debug)]
enum Mixer {
    Gdn(GatedDeltaNet),
    Attention(Attention),
}

#[derive(Debug)]
struct DecoderLayer {
    mixer: Mixer,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    fn new(p: nn::Path, cfg: &GdnConfig, kind: LayerType) -> Self {
        let h = cfg.hidden_size as i64;
        let mixer = match kind {
            LayerType::Gdn => Mixer::Gdn(GatedDeltaNet::new(&p / "linear_attn", cfg)),
            LayerType::Attention => Mixer::Attention(Attention::new(&p / "self_attn", &cfg.dense_shape(), None)),
        };
        Self {
            mixer,
            mlp: Mlp::new(&p / "mlp", &cfg.dense_shape()),
            input_layernorm: RmsNorm::new(&p / "input_layernorm", h, cfg.rms_norm_eps),
            post_attention_layernorm: RmsNorm::new(&p / "post_attention_layernorm", h, cfg.rms_norm_eps),
        }
    }

    fn forward(&self, x: &Tensor, ctx: &Tensor, anchors: &Tensor, attention: Option<&AttentionInputs>) -> Tensor {
        // The context enters as fused (hidden_norm'd), not through input_layernorm.
        let normed = self.input_layernorm.forward(x);
        let mixed = match (&self.mixer, attention) {
            (Mixer::Gdn(gdn), _) => gdn.forward(&normed, ctx, anchors),
            (Mixer::Attention(attn), Some(at)) => attn.forward(&normed, ctx, at),
            (Mixer::Attention(_), None) => unreachable!("attention inputs are built when a layer needs them"),
        };
        let x = x + mixed;
        &x + self.mlp.forward(&self.post_attention_layernorm.forward(&x))
    }
}

#[derive(Debug)]
pub struct GdnDrafter {
    pub cfg: GdnConfig,
    fc: nn::Linear,
    hidden_norm: RmsNorm,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
}

impl GdnDrafter {
    pub fn new(root: &nn::Path, cfg: &GdnConfig) -> Self {
        let h = cfg.hidden_size;
        let n_feat = cfg.dflash_config.target_layer_ids.len();
        Self {
            cfg: cfg.clone(),
            fc: linear(root, "fc", n_feat * h, h, drafter_layers::layers::INITIALIZER_RANGE),
            hidden_norm: RmsNorm::new(root / "hidden_norm", h as i64, cfg.rms_norm_eps),
            layers: cfg
                .layer_types
                .iter()
                .enumerate()
                .map(|(i, &t)| DecoderLayer::new(root / "layers" / i, cfg, t))
                .collect(),
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

        // 2. RoPE tables and the block mask, if any layer attends.
        let attention =
            self.cfg.layer_types.contains(&LayerType::Attention).then(|| {
                AttentionInputs::new(anchors, s, bk, &self.cfg.dense_shape(), block_embeds.kind(), true, None)
            });

        // 3. Decoder layers over the block tokens, then the final norm.
        let mut x = block_embeds.shallow_clone();
        for layer in &self.layers {
            x = layer.forward(&x, &ctx, anchors, attention.as_ref());
        }
        self.norm.forward(&x)
    }
}

/// Build on `device` with weights of `kind`.
pub fn build(cfg: &GdnConfig, device: Device, kind: Kind) -> (nn::VarStore, GdnDrafter) {
    let mut vs = nn::VarStore::new(device);
    let model = GdnDrafter::new(&vs.root(), cfg);
    if kind != Kind::Float {
        vs.set_kind(kind);
    }
    (vs, model)
}
