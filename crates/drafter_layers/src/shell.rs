//! The plugin shell every DFlash drafter shares, whatever its layers: its config.json and
//! weights behind the `DrafterPlugin` accessors, and building it from a `[drafter]` section or
//! from a saved folder (`init_from`). A drafter implements [`DrafterShell`] and puts
//! [`drafter_shell_methods!`](crate::drafter_shell_methods) in its `DrafterPlugin` impl; only
//! its forward (and backward) are its own.

use crate::dflash::DFlashSection;
use plugin_api::{
    abi_stable::std_types::RVec,
    describe::{InputFile, SectionCheck},
    tch::{nn, Device, Kind, Tensor},
    HostContext, NamedTensor, PluginError, TargetSpec,
};
use serde::{de::DeserializeOwned, Serialize};
use std::path::Path;

/// What the shell reads of a drafter's `config.json` type.
pub trait DFlashConfigJson: Serialize {
    fn block_size(&self) -> usize;
    fn dflash(&self) -> &DFlashSection;
}

/// A drafter plugin as the shell sees it.
pub trait DrafterShell: Sized {
    /// The `[drafter]` config section.
    type Section: DeserializeOwned;
    /// The resolved config (the exported `config.json`).
    type Config: DFlashConfigJson;
    /// The plugin's name, for errors.
    const NAME: &'static str;

    fn vs(&self) -> &nn::VarStore;
    fn config(&self) -> &Self::Config;
    /// The section's `init_from` folder, if any.
    fn init_from(section: &Self::Section) -> Option<&str>;
    /// The section resolved against the target, validated.
    fn resolve(section: &Self::Section, target: &TargetSpec) -> Result<Self::Config, PluginError>;
    /// A saved folder's config (checked against the target) and weights.
    fn read_folder(dir: &Path, target: &TargetSpec) -> Result<(Self::Config, Vec<NamedTensor>), PluginError>;
    /// A drafter with random weights.
    fn build(cfg: &Self::Config, device: Device, kind: Kind) -> Self;

    /// Copy weights in by name (every parameter present with its shape).
    fn load(&mut self, weights: RVec<NamedTensor>) -> Result<(), PluginError> {
        crate::weights::load_named(self.vs(), weights)
    }
}

/// What a drafter section's check reports beyond its fields: the saved drafter `init_from` names,
/// which must be there.
pub fn section_inputs(init_from: Option<&str>, ctx: &HostContext) -> Result<SectionCheck, PluginError> {
    let inputs = init_from.map(|p| InputFile::existing("init_from", p, ctx)).transpose()?;
    Ok(SectionCheck { inputs: inputs.into_iter().collect(), ..Default::default() })
}

/// A saved drafter's config.json read as `C` when its `architectures` names `architecture`
/// (None for another drafter's).
pub fn saved_config<C: DeserializeOwned>(config_json: &str, architecture: &str) -> Result<Option<C>, PluginError> {
    let value: serde_json::Value = serde_json::from_str(config_json).map_err(|e| PluginError::new(e.to_string()))?;
    if value["architectures"][0].as_str() != Some(architecture) {
        return Ok(None);
    }
    serde_json::from_value(value).map(Some).map_err(|e| PluginError::new(e.to_string()))
}

/// The drafter a `[drafter]` section asks for, on the context's device and dtype, seeded: from
/// its `init_from` folder, or resolved against the target with random weights. The section
/// comes back for the plugin's own fields.
pub fn create<D: DrafterShell>(config: &str, ctx: &HostContext) -> Result<(D, D::Section), PluginError> {
    let section: D::Section = plugin_api::parse_section(config)?;
    let target = ctx
        .target
        .as_ref()
        .into_option()
        .ok_or_else(|| PluginError::new(format!("the {} drafter needs a target model's spec", D::NAME)))?;
    let (device, kind) = (ctx.tch_device()?, ctx.tch_kind()?);
    plugin_api::tch::manual_seed(ctx.seed as i64);
    let drafter = match D::init_from(&section) {
        Some(dir) => {
            let dir = ctx.resolve_path(dir);
            let (cfg, weights) = D::read_folder(&dir, target).map_err(|e| e.context("field `init_from`"))?;
            let mut d = D::build(&cfg, device, kind);
            d.load(weights.into()).map_err(|e| e.context(format!("field `init_from`: {}", dir.display())))?;
            d
        }
        None => D::build(&D::resolve(&section, target)?, device, kind),
    };
    Ok((drafter, section))
}

/// `DrafterPlugin::config_json`.
pub fn config_json<D: DrafterShell>(d: &D) -> String {
    serde_json::to_string_pretty(d.config()).expect("config serializes")
}

/// `DrafterPlugin::parameters`: every variable, sorted by name, sharing storage with the model.
pub fn parameters<D: DrafterShell>(d: &D) -> Vec<(String, Tensor)> {
    crate::weights::named_parameters(d.vs())
        .into_iter()
        .map(|nt| (nt.name.into_string(), nt.tensor.into_tensor()))
        .collect()
}

/// `DrafterPlugin::load_weights`.
pub fn load_weights<D: DrafterShell>(d: &mut D, weights: Vec<(String, Tensor)>) -> Result<(), PluginError> {
    d.load(weights.into_iter().map(|(n, t)| NamedTensor::new(n, t)).collect())
}

/// The `DrafterPlugin` methods that are the same for every [`DrafterShell`]: `config_json`,
/// `target_layer_ids`, `block_size`, `mask_token_id`, `parameters`, `load_weights`. Used inside
/// `impl DrafterPlugin for X { .. }`, with `DrafterShell` and `DFlashConfigJson` in scope.
#[macro_export]
macro_rules! drafter_shell_methods {
    () => {
        fn config_json(&self) -> String {
            $crate::shell::config_json(self)
        }

        fn target_layer_ids(&self) -> Vec<u32> {
            $crate::shell::DFlashConfigJson::dflash($crate::shell::DrafterShell::config(self)).target_layer_ids.clone()
        }

        fn block_size(&self) -> u32 {
            $crate::shell::DFlashConfigJson::block_size($crate::shell::DrafterShell::config(self)) as u32
        }

        fn mask_token_id(&self) -> u32 {
            $crate::shell::DFlashConfigJson::dflash($crate::shell::DrafterShell::config(self)).mask_token_id
        }

        fn parameters(&self) -> Vec<(String, plugin_api::tch::Tensor)> {
            $crate::shell::parameters(self)
        }

        fn load_weights(
            &mut self,
            weights: Vec<(String, plugin_api::tch::Tensor)>,
        ) -> Result<(), plugin_api::PluginError> {
            $crate::shell::load_weights(self, weights)
        }
    };
}
