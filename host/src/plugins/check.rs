//! `dflash-host plugins check LIB.so|NAME`: the contract of a plugin's kind, run against it,
//! one line per clause (`pass` / `FAIL: why`); exit 1 when a clause fails.
//!
//! The plugin is created from a run config (`--config`, default `configs/tiny.toml`): its
//! kind's section names it (`--section` gives the rest of the section when the config names
//! another plugin), the config's target supplies the spec and tokenizer a drafter and a data
//! loader need. Inputs are small (a few tokens, 8x4 matrices): the kit takes seconds.

use super::{
    handles::{DataHandle, DrafterHandle, OptimizerHandle, TargetHandle},
    PluginRecord, Registry,
};
use crate::config::{PluginSection, RunConfig};
use anyhow::{anyhow, bail, Context, Result};
use plugin_api::{
    abi_stable::std_types::RSome,
    tch::{self, Device, Kind, Tensor},
    DataPosition, DraftInput, ExportedState, HostContext, NamedTensor, ParamState, PluginInstance, PluginKind,
    TensorHandle,
};
use std::{path::PathBuf, process::ExitCode};

/// The default run config: a seconds-long run on the real target and data.
const TINY: &str = include_str!("../../../configs/tiny.toml");

#[derive(clap::Args)]
pub struct CheckArgs {
    /// The plugin: a shared library (path or bare name, as `--plugin` takes it) or the name of
    /// a built-in plugin (`adamw`, `chat`, `dflash`, `hf`, ...).
    plugin: PathBuf,
    /// The run config whose sections create the plugin and its target (default:
    /// configs/tiny.toml, embedded).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The plugin's own config section (TOML, without `plugin = ...`) when the config's section
    /// of its kind names another plugin, e.g. `--section 'lr = 0.05'`.
    #[arg(long)]
    section: Option<String>,
}

/// One clause's outcome.
struct Clause {
    name: &'static str,
    result: Result<()>,
}

pub fn run(plugin_args: &[PathBuf], args: CheckArgs) -> Result<ExitCode> {
    let (record, registry) = resolve(plugin_args, &args.plugin)?;
    let kind = kind_of(&record.kind)?;
    let cfg = match &args.config {
        Some(p) => RunConfig::load(p)?,
        None => RunConfig::from_toml(std::path::Path::new("configs/tiny.toml"), TINY)?,
    };
    let config_dir = args.config.as_deref().map(crate::config::config_dir).unwrap_or_else(|| PathBuf::from("."));
    let mut section = cfg.section(kind.as_str());
    if section.plugin != record.name {
        section = PluginSection {
            kind: section.kind,
            plugin: record.name.clone(),
            config_toml: args.section.clone().unwrap_or_default(),
        };
    } else if let Some(s) = &args.section {
        section.config_toml = s.clone();
    }
    let ctx = super::host_context("cpu", "f32", cfg.seed, &config_dir, &crate::environment::cache_dir());
    crate::say!("checking {} plugin `{}` ({})", record.kind, record.name, record.origin);
    let kit = Kit { registry: &registry, section, ctx, cfg };
    let mut clauses = kit.section_clauses(kind)?;
    clauses.extend(match kind {
        PluginKind::Optimizer => kit.optimizer()?,
        PluginKind::DataLoader => kit.data_loader()?,
        PluginKind::Drafter => kit.drafter()?,
        PluginKind::Target => kit.target()?,
    });
    let mut failed = 0;
    for c in &clauses {
        match &c.result {
            Ok(()) => crate::say!("  pass  {}", c.name),
            Err(e) => {
                failed += 1;
                crate::say!("  FAIL  {}: {}", c.name, format!("{e:#}").replace('\n', " "));
            }
        }
    }
    if failed > 0 {
        crate::say!("{failed} of {} clauses failed", clauses.len());
        return Ok(ExitCode::from(1));
    }
    crate::say!("all {} clauses pass", clauses.len());
    Ok(ExitCode::SUCCESS)
}

/// The registry with the library loaded (probed first), and the plugin's record; a built-in's
/// name when no library of that name exists.
fn resolve(plugin_args: &[PathBuf], arg: &std::path::Path) -> Result<(PluginRecord, Registry)> {
    let text = arg.to_string_lossy().to_string();
    let builtin = Registry::new(plugin_args)?;
    let is_library = text.contains('/') || text.ends_with(".so") || super::find_library(arg).is_ok();
    if !is_library {
        let mut found: Vec<PluginRecord> =
            builtin.plugins.iter().map(|p| p.record.clone()).filter(|r| r.name == text).collect();
        return match found.len() {
            1 => Ok((found.remove(0), builtin)),
            0 => bail!("plugin {text}: no library of that name (see `plugins inspect`) and no plugin named `{text}`"),
            _ => bail!("plugin {text}: several plugins are named `{text}`; give the library's path"),
        };
    }
    let path = super::find_library(arg)?;
    let mut paths = plugin_args.to_vec();
    paths.push(path.clone());
    let registry = Registry::new(&paths)?;
    let shown = path.display().to_string();
    let record = registry
        .plugins
        .iter()
        .map(|p| &p.record)
        .find(|r| r.origin == shown)
        .cloned()
        .ok_or_else(|| anyhow!("plugin {shown}: not registered"))?;
    Ok((record, registry))
}

fn kind_of(kind: &str) -> Result<PluginKind> {
    [PluginKind::Target, PluginKind::Drafter, PluginKind::Optimizer, PluginKind::DataLoader]
        .into_iter()
        .find(|k| k.as_str() == kind)
        .ok_or_else(|| anyhow!("unknown plugin kind `{kind}`"))
}

struct Kit<'a> {
    registry: &'a Registry,
    section: PluginSection,
    ctx: HostContext,
    cfg: RunConfig,
}

impl Kit<'_> {
    fn clause(&self, name: &'static str, f: impl FnOnce() -> Result<()>) -> Clause {
        // The host's own code is checked here too: a panic (a tch shape error on a bad output) is a
        // failed clause, not a crash.
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|p| {
            Err(anyhow!(
                "panicked: {}",
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            ))
        });
        Clause { name, result }
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    if a.size() != b.size() {
        return f64::INFINITY;
    }
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
}

const CPU: (Kind, Device) = (Kind::Float, Device::Cpu);

/// A copy of exported state that owns its tensors (the exporter's live state stays its own).
fn deep_copy(s: &ExportedState) -> ExportedState {
    let params = s
        .params
        .iter()
        .map(|p| ParamState {
            param: p.param.clone(),
            roles: p.roles.iter().map(|r| NamedTensor::new(r.name.as_str(), r.tensor.tensor().copy())).collect(),
        })
        .collect();
    ExportedState { step: s.step, params }
}

/// The same step count, parameters and roles, each tensor equal to float rounding (an exporter
/// may scale its own state to a role's convention and back).
fn same_state(first: &ExportedState, second: &ExportedState) -> Result<()> {
    if first.step != second.step {
        bail!("step {:?} exported, {:?} after the round trip", first.step.into_option(), second.step.into_option());
    }
    for p in &first.params {
        let Some(q) = second.params.iter().find(|q| q.param == p.param) else {
            bail!("`{}` exported, missing after the round trip", p.param);
        };
        for r in &p.roles {
            let Some(t) = q.roles.iter().find(|t| t.name == r.name) else {
                bail!("`{}` {} exported, missing after the round trip", p.param, r.name);
            };
            let (a, b) = (r.tensor.tensor(), t.tensor.tensor());
            let scale = a.abs().max().double_value(&[]).max(1.0);
            let d = max_diff(&a, &b);
            if d > 1e-6 * scale {
                bail!("`{}` {} differs by {d:e} after the round trip", p.param, r.name);
            }
        }
    }
    if let Some(q) = second.params.iter().find(|q| !first.params.iter().any(|p| p.param == q.param)) {
        bail!("`{}` not exported, there after the round trip", q.param);
    }
    Ok(())
}

impl Kit<'_> {
    fn create(&self, kind: PluginKind, section: &PluginSection, ctx: &HostContext) -> Result<PluginInstance> {
        Ok(self.registry.create(kind, section, ctx)?.0)
    }

    fn optimizer_box(&self) -> Result<OptimizerHandle> {
        match self.create(PluginKind::Optimizer, &self.section, &self.ctx)? {
            PluginInstance::Optimizer(o) => Ok(OptimizerHandle::new(o, &self.section.plugin)),
            _ => unreachable!("Registry::create checks the kind"),
        }
    }

    /// A config's target (the data loader's tokenizer, the drafter's spec).
    fn target_box(&self) -> Result<TargetHandle> {
        let section = self.cfg.section("target");
        match self.create(PluginKind::Target, &section, &self.ctx).context("creating the config's target")? {
            PluginInstance::Target(t) => Ok(TargetHandle::new(t, &section.plugin)),
            _ => unreachable!(),
        }
    }

    // ---- every kind: the section's description and check (ABI `describe`, `check`) ----

    fn section_clauses(&self, kind: PluginKind) -> Result<Vec<Clause>> {
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

    // ---- optimizer ----

    fn optimizer(&self) -> Result<Vec<Clause>> {
        // Two matrices, a vector; fixed values, gradients from a seeded generator.
        let params = || -> Vec<(String, Tensor)> {
            tch::manual_seed(1);
            ["layers.0.mlp.up_proj.weight", "layers.0.self_attn.o_proj.weight", "norm.weight"]
                .iter()
                .zip([&[8i64, 4][..], &[4, 8], &[4]])
                .map(|(n, s)| (n.to_string(), Tensor::randn(s, CPU).set_requires_grad(true)))
                .collect()
        };
        let set_grads = |ps: &[(String, Tensor)], seed: i64, scale: f64| {
            tch::manual_seed(seed);
            for (_, p) in ps {
                if !p.grad().defined() {
                    (p * 0.0).sum(Kind::Float).backward(); // creates a (zero) .grad
                }
                p.grad().copy_(&(Tensor::randn(p.size(), CPU) * scale));
            }
        };
        let named = |ps: &[(String, Tensor)]| -> plugin_api::abi_stable::std_types::RVec<NamedTensor> {
            ps.iter().map(|(n, p)| NamedTensor::new(n.clone(), p.shallow_clone())).collect()
        };
        let copy = |ps: &[(String, Tensor)]| -> Vec<(String, Tensor)> {
            ps.iter().map(|(n, p)| (n.clone(), p.detach().copy().set_requires_grad(true))).collect()
        };
        let mut out = Vec::new();
        out.push(self.clause("state save/load round trip gives identical next steps", || {
            let a_params = params();
            let mut a = self.optimizer_box()?;
            a.init(named(&a_params))?;
            for step in 0..2 {
                set_grads(&a_params, 10 + step, 1.0);
                a.step(1.0)?;
            }
            let state: Vec<(String, Tensor)> =
                a.state()?.iter().map(|nt| (nt.name.to_string(), nt.tensor.tensor().copy())).collect();
            let b_params = copy(&a_params);
            let mut b = self.optimizer_box()?;
            b.init(named(&b_params))?;
            b.load_state(state.iter().map(|(n, t)| NamedTensor::new(n.clone(), t.shallow_clone())).collect())?;
            for step in 0..2 {
                set_grads(&a_params, 20 + step, 1.0);
                set_grads(&b_params, 20 + step, 1.0);
                a.step(0.5)?;
                b.step(0.5)?;
            }
            for ((n, pa), (_, pb)) in a_params.iter().zip(&b_params) {
                let d = max_diff(pa, pb);
                if d > 0.0 {
                    bail!("`{n}` differs by {d:e} after two steps from the restored state");
                }
            }
            Ok(())
        }));
        out.push(self.clause("state exported by role round-trips (export, import anew, export again)", || {
            let a_params = params();
            let mut a = self.optimizer_box()?;
            a.init(named(&a_params))?;
            for step in 0..2 {
                set_grads(&a_params, 50 + step, 1.0);
                a.step(1.0)?;
            }
            // An optimizer that exports nothing has nothing to hold here (it cannot be carried).
            let Some(first) = a.export_state()? else { return Ok(()) };
            let b_params = copy(&a_params);
            let mut b = self.optimizer_box()?;
            b.init(named(&b_params))?;
            b.import_state(deep_copy(&first))?.ok_or_else(|| anyhow!("it exports its state but cannot import it"))?;
            let second = b.export_state()?.ok_or_else(|| anyhow!("after an import it exports nothing"))?;
            same_state(&first, &second)
        }));
        out.push(self.clause("zero gradients leave weights unchanged (but for weight decay)", || {
            let ps = params();
            let before = copy(&ps);
            let mut o = self.optimizer_box()?;
            o.init(named(&ps))?;
            set_grads(&ps, 30, 0.0);
            o.step(1.0)?;
            for ((n, p), (_, b)) in ps.iter().zip(&before) {
                // Decoupled weight decay scales a tensor by one factor in (0, 1]; anything else moved it.
                let c =
                    (p.detach() * b).sum(Kind::Double).double_value(&[]) / (b * b).sum(Kind::Double).double_value(&[]);
                let d = max_diff(&p.detach(), &(b * c));
                if !(c > 0.0 && c <= 1.0) || d > 1e-6 {
                    bail!(
                        "`{n}` moved with a zero gradient (max difference {:e} from a decay by {c:.6})",
                        max_diff(&p.detach(), b)
                    );
                }
            }
            Ok(())
        }));
        out.push(self.clause("parameters without gradients are skipped", || {
            let ps = params();
            let before = copy(&ps);
            let mut o = self.optimizer_box()?;
            o.init(named(&ps))?;
            set_grads(&ps[..1], 40, 1.0);
            o.step(1.0)?;
            for ((n, p), (_, b)) in ps.iter().zip(&before).skip(1) {
                if max_diff(&p.detach(), b) != 0.0 {
                    bail!("`{n}` has no gradient but changed");
                }
            }
            if max_diff(&ps[0].1.detach(), &before[0].1) == 0.0 {
                bail!("`{}` has a gradient but did not change", ps[0].0);
            }
            Ok(())
        }));
        Ok(out)
    }

    // ---- data loader ----

    fn data_box(&self, tokenizer: &str) -> Result<DataHandle> {
        let PluginInstance::DataLoader(d) =
            self.create(PluginKind::DataLoader, &self.section, &self.ctx_with_target()?)?
        else {
            unreachable!()
        };
        let mut d = DataHandle::new(d, &self.section.plugin);
        d.open(tokenizer)?;
        if !d.distill_request()?.prompts.is_empty() {
            bail!("the data loader asks for self-distillation; check it with a section that turns it off (e.g. --section '... distill = false')");
        }
        Ok(d)
    }

    fn ctx_with_target(&self) -> Result<HostContext> {
        let mut ctx = self.ctx.clone();
        ctx.target = RSome(self.target_box()?.spec()?);
        Ok(ctx)
    }

    fn data_loader(&self) -> Result<Vec<Clause>> {
        let tokenizer = self.target_box()?.tokenizer_json()?;
        let batches = |d: &mut DataHandle, n: usize| -> Result<Vec<(Tensor, Tensor)>> {
            let mut out = Vec::new();
            for _ in 0..4 * n {
                if out.len() == n {
                    break;
                }
                if let Some(b) = d.next_batch()? {
                    out.push((b.input_ids.tensor(), b.loss_mask.tensor()));
                }
            }
            if out.len() < n {
                bail!("{} batches in {} calls of next_batch", out.len(), 4 * n);
            }
            Ok(out)
        };
        let mut out = Vec::new();
        out.push(self.clause("seeking to a saved position gives the same batches", || {
            let mut a = self.data_box(&tokenizer)?;
            batches(&mut a, 1)?;
            let saved: DataPosition = a.position()?;
            let want = batches(&mut a, 3)?;
            let mut b = self.data_box(&tokenizer)?;
            b.seek(saved)?;
            let got = batches(&mut b, 3)?;
            for (i, ((wi, wm), (gi, gm))) in want.iter().zip(&got).enumerate() {
                if wi.size() != gi.size() || !wi.equal(gi) || !wm.equal(gm) {
                    bail!("batch {} after seeking to {saved:?} differs from the one after that position", i + 1);
                }
            }
            Ok(())
        }));
        out.push(self.clause("the loss mask is on response tokens only", || {
            let mut d = self.data_box(&tokenizer)?;
            let (mut seen, mut calls) = (0, 0);
            while seen < 2 {
                calls += 1;
                if calls > 8 {
                    bail!("no batch in {calls} calls of next_batch");
                }
                let Some(b) = d.next_batch()? else { continue };
                seen += 1;
                let ids: Vec<Vec<i64>> = Vec::try_from(b.input_ids.tensor())?;
                let mask: Vec<Vec<i64>> = Vec::try_from(b.loss_mask.tensor())?;
                for (row, (ids, mask)) in ids.iter().zip(&mask).enumerate() {
                    let len = b.lengths.get(row).copied().unwrap_or(0) as usize;
                    if len == 0 || len > ids.len() {
                        bail!("sequence {row}: length {len} for a row of {} tokens", ids.len());
                    }
                    if mask.iter().any(|&m| m != 0 && m != 1) {
                        bail!("sequence {row}: the loss mask holds values other than 0 and 1");
                    }
                    if mask[len..].contains(&1) {
                        bail!("sequence {row}: padding (positions {len}..) is in the loss mask");
                    }
                    if mask[0] == 1 {
                        bail!("sequence {row}: its first token is in the loss mask (a response always has a prompt before it)");
                    }
                    if !mask.contains(&1) {
                        bail!("sequence {row}: no response token in its loss mask");
                    }
                    if mask.iter().filter(|&&m| m == 1).count() == len - 1 {
                        bail!("sequence {row}: every token after the first is in the loss mask (prompts too?)");
                    }
                }
            }
            Ok(())
        }));
        Ok(out)
    }

    // ---- drafter ----

    fn drafter_box(&self, ctx: &HostContext) -> Result<DrafterHandle> {
        tch::manual_seed(ctx.seed as i64);
        let PluginInstance::Drafter(d) = self.create(PluginKind::Drafter, &self.section, ctx)? else { unreachable!() };
        Ok(DrafterHandle::new(d, &self.section.plugin))
    }

    fn drafter(&self) -> Result<Vec<Clause>> {
        let ctx = self.ctx_with_target()?;
        let spec = ctx.target.clone().unwrap();
        let h = spec.hidden_size as i64;
        let input = |d: &DrafterHandle| -> Result<DraftInput> {
            let (b, s, a, bk) = (2i64, 24i64, 2i64, d.block_size()? as i64);
            let n = d.target_layer_ids()?.len() as i64;
            tch::manual_seed(7);
            Ok(DraftInput {
                target_hidden: TensorHandle::new(Tensor::randn([b, s, n * h], CPU)),
                block_embeds: TensorHandle::new(Tensor::randn([b, a * bk, h], CPU)),
                anchors: TensorHandle::new(Tensor::from_slice(&[3i64, 11, 5, 13]).view([b, a])),
                anchor_valid: TensorHandle::new(Tensor::ones([b, a], (Kind::Bool, Device::Cpu))),
            })
        };
        let forward = |d: &mut DrafterHandle| -> Result<Tensor> {
            let x = input(d)?;
            d.anchors_on_host(&x.anchors)?;
            d.forward(&x)
        };
        let mut out = Vec::new();
        out.push(self.clause("output shape [B, A*Bk, H]", || {
            let mut d = self.drafter_box(&ctx)?;
            let y = tch::no_grad(|| forward(&mut d))?;
            let want = vec![2, 2 * d.block_size()? as i64, h];
            if y.size() != want {
                bail!("output {:?}, expected {want:?}", y.size());
            }
            Ok(())
        }));
        out.push(self.clause("deterministic under a seed", || {
            let mut a = self.drafter_box(&ctx)?;
            let mut b = self.drafter_box(&ctx)?;
            let (ya, yb) = tch::no_grad(|| Ok::<_, anyhow::Error>((forward(&mut a)?, forward(&mut b)?)))?;
            let d = max_diff(&ya, &yb);
            if d > 0.0 {
                bail!("two drafters created with seed {} differ by {d:e}", ctx.seed);
            }
            Ok(())
        }));
        out.push(self.clause("gradients reach every trainable parameter", || {
            let mut d = self.drafter_box(&ctx)?;
            let y = forward(&mut d)?;
            if y.requires_grad() && y.is_leaf() {
                let g = Tensor::ones_like(&y);
                d.backward(&TensorHandle::new(g))?;
            } else {
                (&y * y.ones_like().cumsum(-1, Kind::Float)).sum(Kind::Float).backward();
            }
            let missing: Vec<String> = d
                .parameters()?
                .iter()
                .filter(|p| {
                    let g = p.tensor.tensor().grad();
                    !g.defined() || g.abs().sum(Kind::Double).double_value(&[]) == 0.0
                })
                .map(|p| p.name.to_string())
                .collect();
            if !missing.is_empty() {
                bail!("no gradient for {}", missing.join(", "));
            }
            Ok(())
        }));
        out.push(self.clause("config_json parses and its weights re-create the same model", || {
            let mut a = self.drafter_box(&ctx)?;
            let json = a.config_json()?;
            serde_json::from_str::<serde_json::Value>(&json).map_err(|e| anyhow!("config_json is not JSON: {e}"))?;
            let mut other = ctx.clone();
            other.seed = ctx.seed + 1;
            let mut b = self.drafter_box(&other)?;
            if b.config_json()? != json {
                bail!("the same section gives another config_json");
            }
            let weights: Vec<NamedTensor> = a
                .parameters()?
                .iter()
                .map(|p| NamedTensor::new(p.name.to_string(), p.tensor.tensor().detach().copy()))
                .collect();
            b.load_weights(weights.into())?;
            let (ya, yb) = tch::no_grad(|| Ok::<_, anyhow::Error>((forward(&mut a)?, forward(&mut b)?)))?;
            let d = max_diff(&ya, &yb);
            if d > 0.0 {
                bail!("a drafter given the first one's weights differs by {d:e}");
            }
            Ok(())
        }));
        Ok(out)
    }

    // ---- target ----

    fn target(&self) -> Result<Vec<Clause>> {
        let PluginInstance::Target(t) = self.create(PluginKind::Target, &self.section, &self.ctx)? else {
            unreachable!()
        };
        let mut t = TargetHandle::new(t, &self.section.plugin);
        let spec = t.spec()?;
        let (n, h) = (spec.num_hidden_layers, spec.hidden_size as i64);
        let v = spec.vocab_size as i64;
        let ids = Tensor::from_slice(&[1i64, 5, 9, 2, 7, 3, 8, 4]).remainder(v).view([1, 8]);
        let layers = [0u32, n.saturating_sub(1)];
        let mut out = Vec::new();
        out.push(self.clause("features of the requested layers", || {
            let both = t.forward(&TensorHandle::new(ids.shallow_clone()), &layers, true)?;
            let hidden = both.hidden.tensor();
            if hidden.size() != [1, 8, 2 * h] {
                bail!("features of 2 layers: {:?}, expected [1, 8, {}]", hidden.size(), 2 * h);
            }
            let logits = both.logits.into_option().ok_or_else(|| anyhow!("no logits when asked for"))?.tensor();
            if logits.size() != [1, 8, v] {
                bail!("logits {:?}, expected [1, 8, {v}]", logits.size());
            }
            for (i, &l) in layers.iter().enumerate() {
                let one = t.forward(&TensorHandle::new(ids.shallow_clone()), &[l], false)?.hidden.tensor();
                let d = max_diff(&one, &hidden.narrow(-1, i as i64 * h, h));
                if d > 1e-5 {
                    bail!("layer {l} asked alone differs from its slice of [{}, {}] by {d:e}", layers[0], layers[1]);
                }
            }
            if layers[0] != layers[1] {
                let d = max_diff(&hidden.narrow(-1, 0, h), &hidden.narrow(-1, h, h));
                if d == 0.0 {
                    bail!("layers {} and {} give the same features", layers[0], layers[1]);
                }
            }
            Ok(())
        }));
        out.push(self.clause("KV-cache extend / truncate equals recomputation", || {
            let full = t.forward(&TensorHandle::new(ids.shallow_clone()), &layers, true)?;
            let logits_of = |o: plugin_api::TargetOutput| o.logits.into_option().map(|l| l.tensor()).ok_or_else(|| anyhow!("no logits"));
            let (fh, fl) = (full.hidden.tensor(), logits_of(full)?);
            t.cache_reset()?;
            let a = t.cache_extend(&TensorHandle::new(ids.narrow(1, 0, 5)), &layers)?;
            // Two positions that a truncate drops again, then the true continuation.
            let _ = t.cache_extend(&TensorHandle::new(ids.narrow(1, 6, 2)), &layers)?;
            t.cache_truncate(5)?;
            let b = t.cache_extend(&TensorHandle::new(ids.narrow(1, 5, 3)), &layers)?;
            let hidden = Tensor::cat(&[a.hidden.tensor(), b.hidden.tensor()], 1);
            let logits = Tensor::cat(&[logits_of(a)?, logits_of(b)?], 1);
            let (dh, dl) = (max_diff(&hidden, &fh), max_diff(&logits, &fl));
            let scale = fl.abs().max().double_value(&[]).max(1.0);
            if dh > 1e-3 * fh.abs().max().double_value(&[]).max(1.0) || dl > 1e-3 * scale {
                bail!("extend 5, extend 2, truncate to 5, extend 3 differs from one forward: features by {dh:e}, logits by {dl:e}");
            }
            Ok(())
        }));
        Ok(out)
    }
}
