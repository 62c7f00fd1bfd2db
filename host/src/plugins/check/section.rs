//! Every kind: the section's description and check (ABI `describe`, `check`).

use super::kit::{Clause, Kit};
use crate::plugins::handles::TargetHandle;
use anyhow::{anyhow, bail, Context, Result};
use plugin_api::{PluginInstance, PluginKind};

impl Kit<'_> {
    pub(super) fn section_clauses(&self, kind: PluginKind) -> Result<Vec<Clause>> {
        let plugin = self.registry.find(kind, &self.section.plugin)?;
        let doc = plugin.describe();
        let mut out = Vec::new();
        out.push(self.clause("describes its section: every field with a type, a default and a meaning", || {
            let Some(doc) = doc.as_ref().map_err(|e| anyhow!("{e:#}"))? else {
                bail!("it does not describe its section (declare it with `declare_plugin!(.., section = TYPE)`)")
            };
            for t in doc.tables.iter() {
                for f in t.fields.iter() {
                    if f.name.is_empty() || f.ty.is_empty() || f.default.is_empty() || f.doc.trim().is_empty() {
                        bail!("field `{}` of `{}`: no name, type, default or meaning: {f:?}", f.name, t.type_name);
                    }
                }
            }
            Ok(())
        }));
        out.push(self.clause("its check accepts the section given, every field of it described", || {
            plugin.check(&self.section, &self.ctx)?;
            let table: toml::Table = toml::from_str(&self.section.config_toml).context("the section given")?;
            if let Ok(Some(doc)) = doc.as_ref() {
                if let Some(e) = crate::config::preflight::unknown_field(doc, &table) {
                    bail!("its description has no such field: {e}");
                }
            }
            Ok(())
        }));
        out.push(self.clause("its check refuses an unknown field, naming it", || {
            let mut section = self.section.clone();
            section.config_toml = format!("{}\nno_such_field_zz = 1\n", section.config_toml);
            match plugin.check(&section, &self.ctx) {
                Ok(_) => bail!("`no_such_field_zz = 1` was accepted (parse with deny_unknown_fields)"),
                Err(e) if format!("{e:#}").contains("no_such_field_zz") => Ok(()),
                Err(e) => bail!("the error does not name the field: {e:#}"),
            }
        }));
        out.push(self.clause("the files its check names are there", || {
            let check = plugin.check(&self.section, &self.ctx)?;
            for input in check.inputs.iter() {
                if !std::path::Path::new(input.path.as_str()).exists() {
                    bail!("field `{}`: {}: no such file or folder", input.field, input.path);
                }
            }
            Ok(())
        }));
        if kind == PluginKind::Target {
            out.push(self.clause("what its check says of the target is what it loads", || {
                let check = plugin.check(&self.section, &self.ctx)?;
                let Some(facts) = check.target.into_option() else { return Ok(()) };
                let spec = self.target_of_section()?.spec()?;
                if facts.num_hidden_layers != spec.num_hidden_layers {
                    bail!(
                        "check says {} layers, the loaded target has {}",
                        facts.num_hidden_layers,
                        spec.num_hidden_layers
                    );
                }
                Ok(())
            }));
            out.push(self.clause("its FLOPs, where it counts them, grow with the layers and the head", || {
                let layers = self.target_of_section()?.spec()?.num_hidden_layers.max(2);
                let flops = |layers: u32, logits: bool| -> Result<Option<f64>> {
                    let query = plugin_api::describe::FlopsQuery { layers, batch: 2, seq_len: 16, logits };
                    let parts = plugin.target_flops(&self.section, &self.ctx, query)?;
                    Ok(parts.map(|p| p.iter().map(|part| part.flop).sum()))
                };
                let (Some(one), Some(all), Some(head)) = (flops(1, false)?, flops(layers, false)?, flops(layers, true)?)
                else {
                    return Ok(());
                };
                if !(one > 0.0 && all > one && head > all) {
                    bail!("1 layer {one:e}, {layers} layers {all:e}, with the head {head:e}: expected 0 < each < the next");
                }
                Ok(())
            }));
        }
        Ok(out)
    }

    /// The plugin under check as a target, created from its section.
    fn target_of_section(&self) -> Result<TargetHandle> {
        match self.create(PluginKind::Target, &self.section, &self.ctx)? {
            PluginInstance::Target(t) => Ok(TargetHandle::new(t, &self.section.plugin)),
            _ => unreachable!("Registry::create checks the kind"),
        }
    }
}
