//! A one-layer block drafter: the template for drafter plugins.
//!
//! DFlash's shape in miniature. The target's features (several layers, concatenated) are
//! projected to the hidden size (`fc`, `hidden_norm`) and become the context; each block of
//! `[anchor token, MASK x (Bk-1)]` embeddings runs through one transformer layer whose attention
//! sees the context strictly before its anchor and its own block (both ways), never another
//! block; a final norm gives the block hidden states the host's LM head scores. Weights are
//! seeded from the run's seed, named like z-lab's DFlash checkpoints.

use plugin_api::{
    describe::SectionCheck,
    serde::Deserialize,
    tch::{self, Device, Kind, Tensor},
    Describe, DrafterInput, DrafterPlugin, HostContext, PluginError, PluginInfo, PluginInstance, PluginKind, Section,
};

/// The `[drafter]` section (besides `plugin = "tiny_drafter"`).
#[derive(Debug, Clone, Deserialize, Describe)]
#[serde(crate = "plugin_api::serde", deny_unknown_fields)]
pub struct TinyConfig {
    /// Tokens per block (the anchor and Bk-1 masks).
    #[serde(default = "default_block_size")]
    #[describe(range = ">= 2")]
    pub block_size: u32,
    /// The token whose embedding fills a block's masked positions (default: the last id).
    pub mask_token_id: Option<u32>,
    /// Target layers to read (default: the second and the second-to-last).
    pub target_layers: Option<Vec<u32>>,
    /// The MLP's width (default: twice the hidden size).
    pub intermediate_size: Option<u32>,
}

fn default_block_size() -> u32 {
    4
}

/// What can be checked without the target (its layers and vocabulary are checked at `create`).
impl Section for TinyConfig {
    fn check(&self, _ctx: &HostContext) -> Result<SectionCheck, PluginError> {
        if self.block_size < 2 {
            return Err(PluginError::new(format!("field `block_size`: must be >= 2, got {}", self.block_size)));
        }
        if self.target_layers.as_ref().is_some_and(Vec::is_empty) {
            return Err(PluginError::new("field `target_layers`: must name at least one layer"));
        }
        Ok(SectionCheck::default())
    }
}

/// The model's sizes, all from the config and the target's spec (what `config_json` records).
#[derive(Debug, Clone, PartialEq)]
struct Dims {
    hidden: i64,
    intermediate: i64,
    heads: i64,
    block_size: u32,
    mask_token_id: u32,
    layers: Vec<u32>,
    eps: f64,
}

/// Parameter names (as in the checkpoint) and shapes.
fn parameter_shapes(d: &Dims) -> Vec<(&'static str, Vec<i64>)> {
    let (h, i, n) = (d.hidden, d.intermediate, d.layers.len() as i64);
    vec![
        ("fc.weight", vec![h, n * h]),
        ("hidden_norm.weight", vec![h]),
        ("layers.0.input_layernorm.weight", vec![h]),
        ("layers.0.self_attn.q_proj.weight", vec![h, h]),
        ("layers.0.self_attn.k_proj.weight", vec![h, h]),
        ("layers.0.self_attn.v_proj.weight", vec![h, h]),
        ("layers.0.self_attn.o_proj.weight", vec![h, h]),
        ("layers.0.post_attention_layernorm.weight", vec![h]),
        ("layers.0.mlp.gate_proj.weight", vec![i, h]),
        ("layers.0.mlp.up_proj.weight", vec![i, h]),
        ("layers.0.mlp.down_proj.weight", vec![h, i]),
        ("norm.weight", vec![h]),
    ]
}

pub struct TinyDrafter {
    dims: Dims,
    /// In `parameter_shapes` order; leaves that require grad.
    params: Vec<(String, Tensor)>,
}

impl TinyDrafter {
    fn new(dims: Dims, device: Device, kind: Kind) -> Self {
        let params = parameter_shapes(&dims)
            .into_iter()
            .map(|(name, shape)| {
                // Norm gains start at 1, matrices small and random (from the seeded generator).
                let t = if shape.len() == 1 {
                    Tensor::ones(shape.as_slice(), (kind, device))
                } else {
                    Tensor::randn(shape.as_slice(), (kind, device)) * 0.02
                };
                (name.to_string(), t.set_requires_grad(true))
            })
            .collect();
        Self { dims, params }
    }

    fn w(&self, i: usize) -> &Tensor {
        &self.params[i].1
    }

    /// Which keys each block position may see: [B, T, S + T], true = visible.
    fn visibility(&self, anchors: &Tensor, s: i64, t: i64) -> Tensor {
        let bk = self.dims.block_size as i64;
        let dev = anchors.device();
        // The block of each query position, and that block's anchor: [T], [B, T].
        let block = Tensor::arange(t, (Kind::Int64, dev)).floor_divide_scalar(bk);
        let anchor = anchors.index_select(1, &block);
        // Context: positions strictly before the anchor. Blocks: only the query's own.
        let context = Tensor::arange(s, (Kind::Int64, dev)).view([1, 1, s]).lt_tensor(&anchor.unsqueeze(-1));
        let own =
            block.unsqueeze(1).eq_tensor(&block.unsqueeze(0)).unsqueeze(0).expand([anchors.size()[0], t, t], false);
        Tensor::cat(&[context, own], -1)
    }
}

impl DrafterPlugin for TinyDrafter {
    fn config_json(&self) -> String {
        let d = &self.dims;
        format!(
            r#"{{"architectures": ["TinyDrafter"], "hidden_size": {}, "intermediate_size": {}, "num_attention_heads": {}, "block_size": {}, "mask_token_id": {}, "target_layer_ids": {:?}, "rms_norm_eps": {:e}}}"#,
            d.hidden, d.intermediate, d.heads, d.block_size, d.mask_token_id, d.layers, d.eps
        )
    }

    fn target_layer_ids(&self) -> Vec<u32> {
        self.dims.layers.clone()
    }

    fn block_size(&self) -> u32 {
        self.dims.block_size
    }

    fn mask_token_id(&self) -> u32 {
        self.dims.mask_token_id
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        self.params.iter().map(|(n, p)| (n.clone(), p.shallow_clone())).collect()
    }

    fn load_weights(&mut self, weights: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        if let Some((extra, _)) = weights.iter().find(|(n, _)| !self.params.iter().any(|(m, _)| m == n)) {
            return Err(PluginError::new(format!("weight `{extra}`: not a parameter of this drafter")));
        }
        let _guard = tch::no_grad_guard();
        for (name, p) in &mut self.params {
            let (_, w) = weights
                .iter()
                .find(|(n, _)| n == name)
                .ok_or_else(|| PluginError::new(format!("weight `{name}` missing")))?;
            if w.size() != p.size() {
                return Err(PluginError::new(format!(
                    "weight `{name}`: shape {:?}, expected {:?}",
                    w.size(),
                    p.size()
                )));
            }
            p.f_copy_(w)?;
        }
        Ok(())
    }

    fn forward(&mut self, x: &DrafterInput) -> Result<Tensor, PluginError> {
        let (h, heads, eps) = (self.dims.hidden, self.dims.heads, self.dims.eps);
        let (b, s) = (x.target_hidden.size()[0], x.target_hidden.size()[1]);
        let t = x.block_embeds.size()[1];
        let norm = |v: &Tensor, i: usize| v.rms_norm([h], Some(self.w(i)), eps);
        let linear = |v: &Tensor, i: usize| v.linear::<&Tensor>(self.w(i), None);
        // 1. Context: the target's features projected to [B, S, H].
        let context = norm(&linear(&x.target_hidden, 0), 1);
        // 2. Attention of the blocks [B, T, H] over [context; blocks], per head.
        let blocks = &x.block_embeds;
        let hn = norm(blocks, 2);
        let keys_in = Tensor::cat(&[&context, &hn], 1);
        let split = |v: Tensor, len: i64| v.view([b, len, heads, h / heads]).transpose(1, 2);
        let q = split(linear(&hn, 3), t);
        let k = split(linear(&keys_in, 4), s + t);
        let v = split(linear(&keys_in, 5), s + t);
        let blocked = self.visibility(&x.anchors, s, t).logical_not().unsqueeze(1);
        let scores =
            (q.matmul(&k.transpose(-2, -1)) / ((h / heads) as f64).sqrt()).masked_fill(&blocked, f64::NEG_INFINITY);
        let attn = scores.softmax(-1, scores.kind()).matmul(&v).transpose(1, 2).reshape([b, t, h]);
        let y = blocks + linear(&attn, 6);
        // 3. SwiGLU MLP, then the final norm.
        let yn = norm(&y, 7);
        let y = &y + linear(&(linear(&yn, 8).silu() * linear(&yn, 9)), 10);
        Ok(norm(&y, 11))
    }
}

/// The name a config gives in `plugin = "..."` (`plugins new` replaces it).
const PLUGIN_NAME: &str = "tiny_drafter";

fn info() -> PluginInfo {
    PluginInfo::new(
        PLUGIN_NAME,
        PluginKind::Drafter,
        env!("CARGO_PKG_VERSION"),
        "one-layer block drafter (template plugin)",
    )
}

fn create(config: &str, ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let cfg: TinyConfig = plugin_api::parse_section(config)?;
    cfg.check(ctx)?;
    let spec =
        ctx.target.as_ref().into_option().ok_or_else(|| PluginError::new("a drafter needs the target's spec"))?;
    let n = spec.num_hidden_layers;
    let layers = cfg.target_layers.clone().unwrap_or_else(|| if n >= 4 { vec![1, n - 2] } else { (0..n).collect() });
    if let Some(bad) = layers.iter().find(|&&l| l >= n) {
        return Err(PluginError::new(format!("field `target_layers`: layer {bad}, the target has {n}")));
    }
    let heads = spec.num_attention_heads.max(1) as i64;
    if layers.is_empty() || cfg.block_size < 2 || spec.hidden_size as i64 % heads != 0 {
        return Err(PluginError::new("field `block_size` must be >= 2 and `target_layers` not empty"));
    }
    let mask_token_id = cfg.mask_token_id.unwrap_or(spec.vocab_size.saturating_sub(1));
    if mask_token_id >= spec.vocab_size {
        return Err(PluginError::new(format!(
            "field `mask_token_id`: {mask_token_id}, the vocabulary has {}",
            spec.vocab_size
        )));
    }
    let dims = Dims {
        hidden: spec.hidden_size as i64,
        intermediate: cfg.intermediate_size.map_or(2 * spec.hidden_size as i64, i64::from),
        heads,
        block_size: cfg.block_size,
        mask_token_id,
        layers,
        eps: spec.rms_norm_eps,
    };
    // The same seed gives the same initial weights.
    tch::manual_seed(ctx.seed as i64);
    Ok(PluginInstance::drafter(TinyDrafter::new(dims, ctx.tch_device()?, ctx.tch_kind()?)))
}

plugin_api::declare_plugin!(drafter_tiny, info, create, section = TinyConfig);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_sees_the_context_before_its_anchor_and_itself() {
        let dims =
            Dims { hidden: 8, intermediate: 16, heads: 2, block_size: 2, mask_token_id: 0, layers: vec![0], eps: 1e-6 };
        let d = TinyDrafter::new(dims, Device::Cpu, Kind::Float);
        // One sequence of 4 context positions, blocks at anchors 1 and 3.
        let v = d.visibility(&Tensor::from_slice(&[1i64, 3]).view([1, 2]), 4, 4);
        let rows: Vec<Vec<i64>> = Vec::try_from(v.squeeze_dim(0).to_kind(Kind::Int64)).unwrap();
        assert_eq!(rows[0], [1, 0, 0, 0, 1, 1, 0, 0]);
        assert_eq!(rows[3], [1, 1, 1, 0, 0, 0, 1, 1]);
    }
}
