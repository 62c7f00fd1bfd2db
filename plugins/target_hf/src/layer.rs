//! A decoder layer's parts, and the one place that names every family's token mixer
//! (`attention.rs`, `mla.rs`, `qwen3_5.rs`, `short_conv.rs`) and MLP (dense, `moe.rs`).

use crate::{
    attention::Attention,
    cache::{self, Slot},
    common::{rms_norm, Context, Mlp},
    config::{Arch, DecoderConfig, LayerKind, Mixer},
    mla::Mla,
    moe::SparseMoe,
    qwen3_5::GatedDeltaNet,
    short_conv::ShortConv,
    weights::Loader,
};
use plugin_api::tch::Tensor;

pub(crate) enum TokenMixer {
    Attention(Attention),
    Linear(GatedDeltaNet),
    ShortConv(ShortConv),
    Mla(Mla),
}

impl TokenMixer {
    pub(crate) fn kind(&self) -> Mixer {
        match self {
            Self::Attention(_) => Mixer::Attention,
            Self::Linear(_) => Mixer::Linear,
            Self::ShortConv(_) => Mixer::ShortConv,
            Self::Mla(_) => Mixer::Mla,
        }
    }
}

pub(crate) enum Ffn {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl Ffn {
    fn forward(&self, h: &Tensor) -> Tensor {
        match self {
            Self::Dense(m) => {
                let _r = crate::common::range("mlp");
                m.forward(h)
            }
            Self::Sparse(m) => {
                let _r = crate::common::range("moe");
                m.forward(h)
            }
        }
    }
}

/// A token mixer and an MLP, each in a residual branch: x + out_norm(mixer(norm(x))) (the
/// output norm Gemma's only), then the same with the MLP.
pub(crate) struct Layer {
    pub(crate) mixer: TokenMixer,
    /// Which of the decoder's RoPEs its attention rotates with.
    rope: usize,
    pub(crate) window: Option<i64>,
    ffn: Ffn,
    mixer_norm: Tensor,
    ffn_norm: Tensor,
    mixer_out_norm: Option<Tensor>,
    ffn_out_norm: Option<Tensor>,
}

/// Where a layer's parts are (LongCat-Flash's sublayers have their own).
pub(crate) struct LayerPaths {
    pub mixer: String,
    pub ffn: String,
    pub norms: [String; 2],
    pub out_norms: Option<[String; 2]>,
}

impl LayerPaths {
    /// Layer `i` of a one-mixer family.
    pub(crate) fn plain(cfg: &DecoderConfig, i: usize) -> Self {
        let p = format!("model.layers.{i}");
        let names = cfg.norm_names();
        let mixer = match cfg.mixer(i) {
            Mixer::Attention | Mixer::Mla => "self_attn",
            Mixer::Linear => "linear_attn",
            Mixer::ShortConv => "conv",
        };
        let ffn = if cfg.arch() == Arch::Lfm2 { "feed_forward" } else { "mlp" };
        Self {
            mixer: format!("{p}.{mixer}"),
            ffn: format!("{p}.{ffn}"),
            norms: [format!("{p}.{}.weight", names.mixer), format!("{p}.{}.weight", names.ffn)],
            out_norms: names
                .mixer_out
                .zip(names.ffn_out)
                .map(|(a, f)| [format!("{p}.{a}.weight"), format!("{p}.{f}.weight")]),
        }
    }
}

impl Layer {
    /// Layer `i`'s parts at `paths`; `ffn`: the MLP (a sparse one, or None for the dense MLP
    /// the config gives).
    pub(crate) fn load(
        cfg: &DecoderConfig,
        ld: &mut Loader,
        i: usize,
        paths: &LayerPaths,
        sparse: bool,
    ) -> Result<Self, String> {
        let h = cfg.hidden_size as i64;
        let mixer = match cfg.mixer(i) {
            Mixer::Attention => TokenMixer::Attention(Attention::load(cfg, ld, &paths.mixer)?),
            Mixer::Mla => TokenMixer::Mla(Mla::load(cfg, ld, &paths.mixer)?),
            Mixer::Linear => TokenMixer::Linear(GatedDeltaNet::load(cfg, ld, &paths.mixer)?),
            Mixer::ShortConv => TokenMixer::ShortConv(ShortConv::load(cfg, ld, &paths.mixer)?),
        };
        let ffn = if sparse {
            Ffn::Sparse(SparseMoe::load(cfg, ld, &paths.ffn)?)
        } else {
            let names =
                if cfg.arch() == Arch::Lfm2 { ["w1", "w3", "w2"] } else { ["gate_proj", "up_proj", "down_proj"] };
            let width = cfg.dense_width().unwrap_or(cfg.intermediate_size) as i64;
            Ffn::Dense(Mlp::load_named(ld, &paths.ffn, names, h, width, cfg.activation())?)
        };
        let centred = cfg.centred_norms();
        let out_norms = match &paths.out_norms {
            Some([a, f]) => Some((ld.norm(a, h, centred)?, ld.norm(f, h, centred)?)),
            None => None,
        };
        let (mixer_out_norm, ffn_out_norm) = out_norms.unzip();
        Ok(Self {
            mixer,
            rope: usize::from(cfg.arch() == Arch::Gemma3 && cfg.layer_kind(i) == LayerKind::Sliding),
            window: cfg.window(i).map(|w| w as i64),
            ffn,
            mixer_norm: ld.norm(&paths.norms[0], h, centred)?,
            ffn_norm: ld.norm(&paths.norms[1], h, centred)?,
            mixer_out_norm,
            ffn_out_norm,
        })
    }

    /// x + the token mixer's branch.
    pub(crate) fn mix(&self, x: &Tensor, ctx: &Context, slot: Option<&mut Slot>) -> Tensor {
        let h = rms_norm(x, &self.mixer_norm, ctx.eps);
        let (cos, sin) = &ctx.tables[self.rope];
        let mask = ctx.mask(self.window);
        let out = match &self.mixer {
            TokenMixer::Attention(a) => {
                let _r = crate::common::range("attention");
                a.forward(&h, cos, sin, mask, slot.map(cache::kv), ctx.static_write.as_ref(), ctx.eps)
            }
            TokenMixer::Mla(m) => {
                let _r = crate::common::range("attention");
                m.forward(&h, cos, sin, mask, slot.map(cache::kv))
            }
            TokenMixer::Linear(g) => {
                let _r = crate::common::range("gdn");
                let state = slot.map(|s| match s {
                    Slot::Linear(st) => st,
                    _ => unreachable!("a cache slot follows its layer's kind"),
                });
                g.forward(&h, ctx.valid, state, ctx.rollback)
            }
            TokenMixer::ShortConv(c) => {
                let _r = crate::common::range("conv");
                let state = slot.map(|s| match s {
                    Slot::Conv(st) => st,
                    _ => unreachable!("a cache slot follows its layer's kind"),
                });
                c.forward(&h, ctx.valid, state, ctx.rollback)
            }
        };
        let out = ctx.reduce(out, "a token mixer's output");
        match &self.mixer_out_norm {
            Some(n) => x + rms_norm(&out, n, ctx.eps),
            None => x + out,
        }
    }

    /// The MLP's input (normed).
    pub(crate) fn ffn_input(&self, x: &Tensor, ctx: &Context) -> Tensor {
        rms_norm(x, &self.ffn_norm, ctx.eps)
    }

    /// The MLP's branch for its input `h`.
    pub(crate) fn ffn_output(&self, h: &Tensor, ctx: &Context) -> Tensor {
        let y = ctx.reduce(self.ffn.forward(h), "an MLP's output");
        match &self.ffn_out_norm {
            Some(n) => rms_norm(&y, n, ctx.eps),
            None => y,
        }
    }

    /// x + the MLP's branch.
    pub(crate) fn feed(&self, x: &Tensor, ctx: &Context) -> Tensor {
        x + self.ffn_output(&self.ffn_input(x, ctx), ctx)
    }
}
