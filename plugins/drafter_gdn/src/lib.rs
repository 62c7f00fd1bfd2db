//! `drafter_gdn`: a hybrid DFlash drafter, Gated DeltaNet layers with dense block attention
//! layers (default 4 GDN : 1 attention), as a plugin named `gdn`.
//!
//! Everything DFlash fixes stays: the fused target features (`fc` + `hidden_norm`), blocks of
//! `[anchor, MASK x (Bk-1)]`, the final norm and the target's LM head, the config section of the
//! dense drafter (changing `plugin = "dflash"` to `"gdn"` is enough). What changes is the token
//! mixer of most layers: a Gated DeltaNet (`gdn.rs`; the recurrence and the conv in the
//! `gated_deltanet` crate, which the hybrid targets share).
//!
//! DFlash's visibility rule, for a recurrence: block j sees the context strictly before its
//! anchor and itself, never another block.
//! - The context is a causal stream: each GDN layer runs its recurrence over the fused context
//!   once per sequence, and reads off the state after the first `anchor` positions for every
//!   anchor (boundary states of the chunked scan plus a partial-chunk sum, `states_at`), so the
//!   state a block starts from has consumed exactly the positions before its anchor.
//! - Each block is an independent sequence of Bk tokens starting from that state (blocks batched
//!   as B*A sequences), its short conv reading the K-1 context rows before the anchor as history:
//!   the block continues the context stream exactly as generation would. Blocks share nothing.
//! - Inside a block the recurrence is causal (token k reads tokens 0..=k of its block); the
//!   attention layers keep DFlash's bidirectional block attention and give the later block
//!   tokens' information to the earlier ones. Why not bidirectional GDN: a recurrence has a
//!   direction, and a reverse pass would double the cost for what one attention layer in five
//!   already provides.
//!
//! Why this and not the alternatives: one recurrence over the context per layer (cost linear in
//! S, like generation with a state cache) instead of re-running the context per block (S*A), and
//! the state at the anchor is what the drafter would have at inference with a recurrent cache,
//! so training and drafting see the same thing. The price: the B*A block start states
//! [B*A, nv, dk, dv] are materialised (fp32) for the backward pass.

pub mod config;
pub mod gdn;

/// The gated delta rule, re-exported from the crate that holds it.
pub use gated_deltanet::delta_rule;
pub mod model;

#[cfg(test)]
mod tests;

pub use config::{DrafterSection, GdnConfig, LayerType};
pub use drafter_layers::shell::DrafterShell;
use plugin_api::{
    tch::{nn, Device, Kind, Tensor},
    DrafterInput, DrafterPlugin, HostContext, NamedTensor, PluginError, PluginInfo, PluginInstance, PluginKind,
    TargetSpec,
};

pub struct GdnPlugin {
    vs: nn::VarStore,
    model: model::GdnDrafter,
}

impl GdnPlugin {
    pub fn new(cfg: &GdnConfig, device: Device, kind: Kind) -> Self {
        let (vs, model) = model::build(cfg, device, kind);
        Self { vs, model }
    }
}

impl DrafterShell for GdnPlugin {
    type Section = DrafterSection;
    type Config = GdnConfig;
    const NAME: &'static str = "gdn";

    fn vs(&self) -> &nn::VarStore {
        &self.vs
    }
    fn config(&self) -> &GdnConfig {
        &self.model.cfg
    }
    fn init_from(section: &DrafterSection) -> Option<&str> {
        section.init_from.as_deref()
    }
    fn resolve(section: &DrafterSection, target: &TargetSpec) -> Result<GdnConfig, PluginError> {
        section.resolve(target)
    }
    fn read_folder(dir: &std::path::Path, target: &TargetSpec) -> Result<(GdnConfig, Vec<NamedTensor>), PluginError> {
        read_folder(dir, target)
    }
    fn build(cfg: &GdnConfig, device: Device, kind: Kind) -> Self {
        Self::new(cfg, device, kind)
    }
}

impl DrafterPlugin for GdnPlugin {
    drafter_layers::drafter_shell_methods!();

    fn forward(&mut self, input: &DrafterInput) -> Result<Tensor, PluginError> {
        Ok(self.model.forward(&input.target_hidden, &input.block_embeds, &input.anchors))
    }
}

fn info() -> PluginInfo {
    PluginInfo::new(
        "gdn",
        PluginKind::Drafter,
        env!("CARGO_PKG_VERSION"),
        "DFlash drafter with Gated DeltaNet layers (default 4 GDN : 1 dense attention)",
    )
}

/// Read a GDN drafter folder (config.json + model.safetensors, as `dflash-host export` writes
/// it): its config, checked against the target, and weights.
pub fn read_folder(dir: &std::path::Path, target: &TargetSpec) -> Result<(GdnConfig, Vec<NamedTensor>), PluginError> {
    let cfg: GdnConfig = drafter_layers::dflash::read_config(dir)?;
    cfg.check_saved().map_err(|e| PluginError::new(format!("{}: {e}", dir.join("config.json").display())))?;
    drafter_layers::dflash::check_fits(dir, cfg.hidden_size, cfg.vocab_size, &cfg.dflash_config, target)?;
    Ok((cfg, drafter_layers::dflash::read_weights(dir)?))
}

fn create(config: &str, ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let (drafter, _) = drafter_layers::shell::create::<GdnPlugin>(config, ctx)?;
    Ok(PluginInstance::drafter(drafter))
}

impl plugin_api::Section for DrafterSection {
    /// The fields as far as they go without the target, and the saved drafter `init_from` names.
    fn check(&self, ctx: &HostContext) -> Result<plugin_api::describe::SectionCheck, PluginError> {
        DrafterSection::check(self)?;
        drafter_layers::shell::section_inputs(self.init_from.as_deref(), ctx)
    }

    /// A saved config of this drafter (`architectures` = `DFlashGdnDraftModel`), checked, and the shapes it
    /// implies.
    fn saved_shapes(config_json: &str) -> Result<Option<plugin_api::describe::Shapes>, PluginError> {
        let Some(cfg) = drafter_layers::shell::saved_config::<GdnConfig>(config_json, "DFlashGdnDraftModel")? else {
            return Ok(None);
        };
        cfg.check_saved().map_err(PluginError::new)?;
        Ok(Some(cfg.parameter_shapes()))
    }
}

plugin_api::declare_plugin!(drafter_gdn, info, create, section = DrafterSection);
