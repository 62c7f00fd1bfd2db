//! LongCat-Flash's decoder layer (transformers' `LongcatFlashDecoderLayer`): two sublayers, each
//! latent attention then a dense MLP (`self_attn.{0,1}`, `mlps.{0,1}`, `input_layernorm.{0,1}`,
//! `post_attention_layernorm.{0,1}`), and one MoE (`mlp`, routed and zero-computation experts)
//! on a shortcut: it reads the first sublayer's MLP input, and its output is added to the
//! layer's.
//!
//!   x1 = x + attn0(norm(x));           h = norm(x1)
//!   x2 = x1 + mlp0(h);                 shortcut = moe(h)
//!   x3 = x2 + attn1(norm(x2))
//!   out = x3 + mlp1(norm(x3)) + shortcut
//!
//! A layer's output is what the drafter reads as that layer's feature (its index among the
//! `num_layers` layers, as transformers' `hidden_states` counts them).

use crate::{
    cache::Slot,
    common::Context,
    config::DecoderConfig,
    layer::{Layer, LayerPaths},
    moe::SparseMoe,
    weights::Loader,
};
use plugin_api::tch::Tensor;

pub(crate) struct LongcatLayer {
    pub sublayers: [Layer; 2],
    moe: SparseMoe,
}

impl LongcatLayer {
    pub(crate) fn load(cfg: &DecoderConfig, ld: &mut Loader, i: usize) -> Result<Self, String> {
        let p = format!("model.layers.{i}");
        let sub = |j: usize| LayerPaths {
            mixer: format!("{p}.self_attn.{j}"),
            ffn: format!("{p}.mlps.{j}"),
            norms: [format!("{p}.input_layernorm.{j}.weight"), format!("{p}.post_attention_layernorm.{j}.weight")],
            out_norms: None,
        };
        let first = Layer::load(cfg, ld, i, &sub(0), false)?;
        let second = Layer::load(cfg, ld, i, &sub(1), false)?;
        Ok(Self { sublayers: [first, second], moe: SparseMoe::load(cfg, ld, &format!("{p}.mlp"))? })
    }

    pub(crate) fn forward(&self, x: &Tensor, ctx: &Context, slots: Option<&mut [Slot]>) -> Tensor {
        let [first, second] = &self.sublayers;
        let (slot0, slot1) = match slots {
            Some([a, b]) => (Some(a), Some(b)),
            _ => (None, None),
        };
        let x = first.mix(x, ctx, slot0);
        let h = first.ffn_input(&x, ctx);
        let shortcut = {
            let _r = crate::common::range("moe");
            ctx.reduce(self.moe.forward(&h), "an MLP's output")
        };
        let x = x + first.ffn_output(&h, ctx);
        let x = second.mix(&x, ctx, slot1);
        let h = second.ffn_input(&x, ctx);
        x + second.ffn_output(&h, ctx) + shortcut
    }
}
