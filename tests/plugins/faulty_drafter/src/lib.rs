//! A drafter plugin ("faulty_drafter") that scales the block embeddings by one trainable gain,
//! and breaks on request: `dead_parameter = true` adds a parameter its forward never uses
//! (`plugins check`: no gradient reaches it); `panic_in = "METHOD"` panics in that method, on its
//! `panic_at_call`-th call (default 1): `parameters` at 2 is the first checkpoint of a run;
//! `panic_with` is the panic's message (a libtorch error's text, say), which `forward` returns as
//! its error instead at its `error_at_forward`-th call. Its
//! section's description, written by hand, leaves `dead_parameter` out (`plugins check` names
//! it).

use plugin_api::{
    describe::{Describe, FieldDoc, TableDoc},
    serde::Deserialize,
    tch::{Device, Kind, Tensor},
    DrafterInput, DrafterPlugin, HostContext, PluginError, PluginInfo, PluginInstance, PluginKind,
};
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Deserialize)]
#[serde(crate = "plugin_api::serde", deny_unknown_fields)]
struct Config {
    #[serde(default)]
    dead_parameter: bool,
    #[serde(default)]
    panic_in: String,
    #[serde(default = "first")]
    panic_at_call: u64,
    #[serde(default)]
    panic_with: String,
    #[serde(default)]
    error_at_forward: u64,
}

/// Described by hand, `dead_parameter` missing: what a description out of step with its struct
/// looks like.
impl Describe for Config {
    fn type_name() -> &'static str {
        "Config"
    }
    fn fields() -> Vec<FieldDoc> {
        vec![
            FieldDoc::new("panic_in", "string".into(), "\"\"".into(), "", "A method that panics."),
            FieldDoc::new("panic_at_call", "integer".into(), "1".into(), ">= 1", "Which call of it panics."),
            FieldDoc::new(
                "panic_with",
                "string".into(),
                "\"\"".into(),
                "",
                "The panic's message (default: which method).",
            ),
            FieldDoc::new(
                "error_at_forward",
                "integer".into(),
                "0".into(),
                "",
                "The call of `forward` that returns `panic_with` as its error (0: none).",
            ),
        ]
    }
    fn nested_tables() -> Vec<TableDoc> {
        Vec::new()
    }
}

impl plugin_api::Section for Config {}

fn first() -> u64 {
    1
}

struct Faulty {
    cfg: Config,
    params: Vec<(String, Tensor)>,
    vocab: u32,
    calls: AtomicU64,
    forwards: AtomicU64,
}

impl Faulty {
    fn maybe_panic(&self, method: &str) {
        if self.cfg.panic_in == method && self.calls.fetch_add(1, Ordering::Relaxed) + 1 == self.cfg.panic_at_call {
            match self.cfg.panic_with.as_str() {
                "" => panic!("deliberate panic in {method}"),
                message => panic!("{message}"),
            }
        }
    }
}

impl DrafterPlugin for Faulty {
    fn config_json(&self) -> String {
        self.maybe_panic("config_json");
        r#"{"architectures": ["Faulty"]}"#.into()
    }

    fn target_layer_ids(&self) -> Vec<u32> {
        self.maybe_panic("target_layer_ids");
        vec![0]
    }

    fn block_size(&self) -> u32 {
        self.maybe_panic("block_size");
        4
    }

    fn mask_token_id(&self) -> u32 {
        self.maybe_panic("mask_token_id");
        self.vocab - 1
    }

    fn parameters(&self) -> Vec<(String, Tensor)> {
        self.maybe_panic("parameters");
        self.params.iter().map(|(n, p)| (n.clone(), p.shallow_clone())).collect()
    }

    fn load_weights(&mut self, weights: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        let _guard = plugin_api::tch::no_grad_guard();
        for (name, p) in &mut self.params {
            let (_, w) =
                weights.iter().find(|(n, _)| n == name).ok_or_else(|| PluginError::new(format!("`{name}` missing")))?;
            p.f_copy_(w)?;
        }
        Ok(())
    }

    fn forward(&mut self, input: &DrafterInput) -> Result<Tensor, PluginError> {
        self.maybe_panic("forward");
        if self.forwards.fetch_add(1, Ordering::Relaxed) + 1 == self.cfg.error_at_forward {
            return Err(PluginError::new(self.cfg.panic_with.clone()));
        }
        Ok(&input.block_embeds * &self.params[0].1)
    }
}

fn info() -> PluginInfo {
    PluginInfo::new("faulty_drafter", PluginKind::Drafter, "0.1.0", "test drafter that breaks on request")
}

fn create(config: &str, ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let cfg: Config = plugin_api::parse_section(config)?;
    let spec = ctx.target.as_ref().into_option().ok_or_else(|| PluginError::new("no target spec"))?;
    let h = spec.hidden_size as i64;
    let mut params =
        vec![("gain.weight".to_string(), Tensor::ones([h], (Kind::Float, Device::Cpu)).set_requires_grad(true))];
    if cfg.dead_parameter {
        params
            .push(("unused.weight".to_string(), Tensor::ones([h], (Kind::Float, Device::Cpu)).set_requires_grad(true)));
    }
    Ok(PluginInstance::drafter(Faulty {
        cfg,
        params,
        vocab: spec.vocab_size,
        calls: AtomicU64::new(0),
        forwards: AtomicU64::new(0),
    }))
}

plugin_api::declare_plugin!(faulty_drafter, info, create, section = Config);
