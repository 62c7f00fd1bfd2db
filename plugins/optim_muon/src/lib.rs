//! Muon for hidden matrices plus AdamW for everything Muon must not touch.
//!
//! The Muon group follows torch.optim.Muon 2.11 step for step: `buf = lerp(buf, g, 1-mu)`;
//! Nesterov direction `lerp(g, buf, mu)`; Newton-Schulz (`ns_dtype`); `p *= 1 - lr*wd`;
//! `p -= adjusted_lr(lr, shape) * O`. Parameters the config routes to AdamW (embeddings, LM head,
//! tensors with < 2 dims or a size-1 dim such as depthwise conv kernels, `adamw_patterns`, and
//! `no_decay_patterns` without weight decay) get torch.optim.AdamW's update. Fused matrices named
//! in `split` are orthogonalised part by part along dim 0, each part with its own shape scaling.
//! Tensors with more than 2 dims (and no size-1 dim) are treated as `[shape[0], rest]` matrices.
//!
//! Data-parallel (the host lends its collectives): every rank keeps the whole state and updates
//! every momentum buffer, but each matrix part is orthogonalised by one rank only (the work split
//! by Newton-Schulz cost, `shard_by_cost`), and the updates are all-gathered in one flat buffer:
//! the same step as one process, with the Newton-Schulz work split R ways instead of repeated.
//!
//! State and math in fp32; parameters of another dtype keep an fp32 master copy (`.master`).
//! Checkpoint names: `step`, `<param>.momentum_buffer` (Muon group), `<param>.exp_avg` and
//! `<param>.exp_avg_sq` (AdamW group), `<param>.master` (non-fp32 parameters). By role (a fork's
//! carry): the momentum buffer and `exp_avg` are `first_moment`, `exp_avg_sq` `second_moment`.

pub mod config;

pub use config::{glob_match, Group, MuonConfig, NsDtype, SplitRule};
pub use optim_math::{adjusted_lr, muon_update, zeropower_via_newtonschulz5, AdjustLr, NS_COEFFICIENTS};

use optim_math::{
    adamw_update,
    carry::{self, AdamCarry, Roles},
    muon_momentum, newton_schulz_cost, shard_by_cost, ParamsAdamW,
};
use plugin_api::{
    roles,
    tch::{Kind, Tensor},
    CollectivesBox, HostContext, Imported, PluginError, PluginInfo, PluginInstance, PluginKind, StateByRole,
    TensorHandle,
};
use std::collections::HashMap;

/// A parameter in the Muon group.
struct MuonSlot {
    name: String,
    param: Tensor,
    /// fp32 master weights when the parameter is not fp32.
    master: Option<Tensor>,
    /// fp32, the parameter's shape.
    momentum_buffer: Tensor,
    /// The parameter as a `[rows, cols]` matrix: rows of each part orthogonalised on its own (one
    /// part = the whole matrix), and the column count.
    parts: Vec<i64>,
    cols: i64,
}

/// A parameter in the AdamW group.
struct AdamSlot {
    name: String,
    param: Tensor,
    master: Option<Tensor>,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// False for `no_decay_patterns`.
    decay: bool,
}

pub struct Muon {
    cfg: MuonConfig,
    muon: Vec<MuonSlot>,
    adamw: Vec<AdamSlot>,
    /// Steps taken (AdamW's bias correction counts from it).
    step: i64,
    /// The data-parallel ranks' collectives, when the host lent them (distributed Muon).
    collectives: Option<CollectivesBox>,
}

/// One matrix part's Newton-Schulz work in a step: where it goes and which rank computes it.
struct Unit {
    slot: usize,
    start: i64,
    rows: i64,
    owner: usize,
    /// The orthogonalised direction (fp32, `[rows, cols]`), on its owner, or on every rank once
    /// gathered.
    update: Option<Tensor>,
}

/// Contiguous, so a Muon master can always be viewed as `[rows, cols]`.
fn fp32_master(param: &Tensor) -> Option<Tensor> {
    (param.kind() != Kind::Float).then(|| param.detach().to_kind(Kind::Float).contiguous())
}

fn zeros_like_f32(param: &Tensor) -> Tensor {
    Tensor::zeros(param.size(), (Kind::Float, param.device()))
}

impl Muon {
    pub fn new(cfg: MuonConfig) -> Self {
        Self { cfg, muon: Vec::new(), adamw: Vec::new(), step: 0, collectives: None }
    }

    /// Split the Newton-Schulz work across data-parallel ranks (what `set_collectives` does).
    pub fn with_collectives(mut self, collectives: CollectivesBox) -> Self {
        self.collectives = Some(collectives);
        self
    }

    /// Each parameter's group, Muon group first, in `init` order within a group.
    pub fn groups(&self) -> Vec<(String, Group)> {
        let muon = self.muon.iter().map(|s| (s.name.clone(), Group::Muon));
        let adamw =
            self.adamw.iter().map(|s| (s.name.clone(), if s.decay { Group::AdamW } else { Group::AdamWNoDecay }));
        muon.chain(adamw).collect()
    }

    fn init_impl(&mut self, params: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        let mut muon = Vec::new();
        let mut adamw = Vec::new();
        let mut split_used = vec![false; self.cfg.split.len()];
        for (name, param) in params {
            let shape = param.size();
            let group = self.cfg.route(&name, &shape);
            let split = self.cfg.split.iter().position(|r| glob_match(&r.pattern, &name));
            if let Some(i) = split {
                split_used[i] = true;
            }
            if group != Group::Muon {
                if let Some(i) = split {
                    return Err(PluginError::new(format!(
                        "field `split[{i}].pattern`: `{}` matches parameter `{name}` (shape {shape:?}), which goes to AdamW",
                        self.cfg.split[i].pattern
                    )));
                }
                let master = fp32_master(&param);
                let (exp_avg, exp_avg_sq) = (zeros_like_f32(&param), zeros_like_f32(&param));
                adamw.push(AdamSlot { name, master, exp_avg, exp_avg_sq, decay: group == Group::AdamW, param });
                continue;
            }
            let rows = shape[0];
            let cols = shape[1..].iter().product::<i64>();
            let parts = match split {
                None => vec![rows],
                Some(i) => {
                    let rule = &self.cfg.split[i];
                    let total: i64 = rule.parts.iter().sum();
                    if total != rows {
                        return Err(PluginError::new(format!(
                            "field `split[{i}].parts`: {:?} sum to {total}, but parameter `{name}` has {rows} rows (shape {shape:?})",
                            rule.parts
                        )));
                    }
                    rule.parts.clone()
                }
            };
            let master = fp32_master(&param);
            // The update writes through a [rows, cols] view of what it updates (checked here, so a
            // step never fails half way).
            if let Err(e) = master.as_ref().unwrap_or(&param).f_view([rows, cols]) {
                return Err(PluginError::new(format!(
                    "parameter `{name}` (shape {shape:?}): not viewable as [{rows}, {cols}]: {e}"
                )));
            }
            muon.push(MuonSlot { name, momentum_buffer: zeros_like_f32(&param), master, param, parts, cols });
        }
        if let Some(i) = split_used.iter().position(|used| !used) {
            return Err(PluginError::new(format!(
                "field `split[{i}].pattern`: `{}` matches no parameter",
                self.cfg.split[i].pattern
            )));
        }
        self.muon = muon;
        self.adamw = adamw;
        self.step = 0;
        Ok(())
    }

    fn step_impl(&mut self, lr_scale: f64) -> Result<(), PluginError> {
        self.step += 1;
        let c = &self.cfg;
        let lr = c.lr * lr_scale;
        let _guard = plugin_api::tch::no_grad_guard();
        let (rank, world) = self.collectives.as_ref().map_or((0, 1), |k| (k.rank() as usize, k.world() as usize));
        // 1. Momentum for every part on every rank (each keeps the whole state, so any rank's
        //    checkpoint is complete); Newton-Schulz only for the parts this rank owns.
        let mut units = Vec::new();
        for (i, s) in self.muon.iter_mut().enumerate() {
            let grad = s.param.grad();
            if !grad.defined() {
                continue; // like torch: parameters without a gradient are left alone
            }
            let rows: i64 = s.parts.iter().sum();
            let grad = grad.to_kind(Kind::Float).reshape([rows, s.cols]);
            let buf = s.momentum_buffer.view([rows, s.cols]);
            let mut start = 0;
            for &n in &s.parts {
                let direction =
                    muon_momentum(&grad.narrow(0, start, n), &mut buf.narrow(0, start, n), c.momentum, c.nesterov);
                units.push(Unit { slot: i, start, rows: n, owner: 0, update: Some(direction) });
                start += n;
            }
        }
        let costs: Vec<f64> = units.iter().map(|u| newton_schulz_cost(u.rows, self.muon[u.slot].cols)).collect();
        for (u, owner) in units.iter_mut().zip(shard_by_cost(&costs, world)) {
            u.owner = owner;
            let s = &self.muon[u.slot];
            u.update = match (owner == rank, u.update.take()) {
                (true, Some(d)) => {
                    let ns_kind = c.ns_dtype.kind(s.param.device());
                    Some(zeropower_via_newtonschulz5(&d.to_kind(ns_kind), c.ns_steps, c.eps).to_kind(Kind::Float))
                }
                _ => None,
            };
        }
        // 2. Every rank's updates to every rank.
        if let Some(k) = self.collectives.as_mut() {
            gather_updates(k, &mut units, &self.muon, world)?;
        }
        // 3. Apply: decoupled weight decay, then each part's update at its shape's rate.
        let mut by_slot = units.into_iter().peekable();
        while let Some(first) = by_slot.next() {
            let s = &mut self.muon[first.slot];
            let rows: i64 = s.parts.iter().sum();
            let p = s.master.as_mut().unwrap_or(&mut s.param);
            let _ = p.g_mul_scalar_(1.0 - lr * c.weight_decay);
            let p2d = p.view([rows, s.cols]); // checked in init
            let mut unit = Some(first);
            while let Some(u) = unit {
                let update = u.update.expect("every update is computed or gathered");
                let step_lr = adjusted_lr(lr, c.adjust_lr, u.rows, s.cols);
                let _ = p2d.narrow(0, u.start, u.rows).g_add_(&(update * -step_lr));
                unit = by_slot.next_if(|n| n.slot == u.slot);
            }
            if let Some(master) = &s.master {
                s.param.copy_(master);
            }
        }
        let adamw = c.adamw_params();
        let adamw_lr = adamw.lr * lr_scale;
        let no_decay = ParamsAdamW { weight_decay: 0.0, ..adamw };
        for s in &mut self.adamw {
            let grad = s.param.grad();
            if !grad.defined() {
                continue;
            }
            let grad = grad.to_kind(Kind::Float);
            let h = if s.decay { &adamw } else { &no_decay };
            let p = s.master.as_mut().unwrap_or(&mut s.param);
            adamw_update(p, &grad, &mut s.exp_avg, &mut s.exp_avg_sq, self.step, adamw_lr, h);
            if let Some(master) = &s.master {
                s.param.copy_(master);
            }
        }
        Ok(())
    }

    fn state_impl(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("step".to_string(), Tensor::from(self.step))];
        for s in &self.muon {
            out.push((format!("{}.momentum_buffer", s.name), s.momentum_buffer.shallow_clone()));
            if let Some(m) = &s.master {
                out.push((format!("{}.master", s.name), m.shallow_clone()));
            }
        }
        for s in &self.adamw {
            out.push((format!("{}.exp_avg", s.name), s.exp_avg.shallow_clone()));
            out.push((format!("{}.exp_avg_sq", s.name), s.exp_avg_sq.shallow_clone()));
            if let Some(m) = &s.master {
                out.push((format!("{}.master", s.name), m.shallow_clone()));
            }
        }
        out
    }

    /// Replace the state; nothing changes unless every entry is present, shaped right, and no
    /// entry is left over. The error lists every mismatch by name.
    fn load_state_impl(&mut self, state: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        let mut by_name: HashMap<String, Tensor> = state.into_iter().collect();
        let mut problems = Vec::new();
        let step = match by_name.remove("step") {
            Some(t) if t.numel() == 1 => Some(t.int64_value(&[])),
            Some(t) => {
                problems.push(format!("`step`: shape {:?}, expected a scalar", t.size()));
                None
            }
            None => {
                problems.push("missing `step`".to_string());
                None
            }
        };
        let _guard = plugin_api::tch::no_grad_guard();
        let mut take = |name: String, like: &Tensor| -> Option<Tensor> {
            match by_name.remove(&name) {
                None => {
                    problems.push(format!("missing `{name}`"));
                    None
                }
                Some(t) if t.size() != like.size() => {
                    problems.push(format!("`{name}`: shape {:?}, expected {:?}", t.size(), like.size()));
                    None
                }
                // A copy: the caller's tensors (maybe another optimizer's live state) stay untouched.
                Some(t) => Some(t.to_device(like.device()).to_kind(Kind::Float).copy().contiguous()),
            }
        };
        // Per slot: each state tensor (None: missing or misshapen), and the master when it has one.
        type Loaded = (Option<Tensor>, Option<Option<Tensor>>);
        type LoadedAdam = (Option<Tensor>, Option<Tensor>, Option<Option<Tensor>>);
        let muon: Vec<Loaded> = self
            .muon
            .iter()
            .map(|s| {
                let buf = take(format!("{}.momentum_buffer", s.name), &s.param);
                let master = s.master.as_ref().map(|_| take(format!("{}.master", s.name), &s.param));
                (buf, master)
            })
            .collect();
        let adamw: Vec<LoadedAdam> = self
            .adamw
            .iter()
            .map(|s| {
                let m = take(format!("{}.exp_avg", s.name), &s.param);
                let v = take(format!("{}.exp_avg_sq", s.name), &s.param);
                let master = s.master.as_ref().map(|_| take(format!("{}.master", s.name), &s.param));
                (m, v, master)
            })
            .collect();
        let mut left: Vec<&String> = by_name.keys().collect();
        left.sort();
        problems.extend(left.into_iter().map(|n| format!("unexpected `{n}`")));
        if !problems.is_empty() {
            return Err(PluginError::new(format!("optimizer state: {}", problems.join("; "))));
        }
        // Everything is present and shaped right: commit.
        self.step = step.expect("checked");
        for (s, (buf, master)) in self.muon.iter_mut().zip(muon) {
            s.momentum_buffer = buf.expect("checked");
            if let Some(m) = master {
                s.master = m;
            }
        }
        for (s, (m, v, master)) in self.adamw.iter_mut().zip(adamw) {
            s.exp_avg = m.expect("checked");
            s.exp_avg_sq = v.expect("checked");
            if let Some(m) = master {
                s.master = m;
            }
        }
        Ok(())
    }
}

impl Muon {
    /// The state by role: each matrix's momentum as its first moment; the AdamW group's two
    /// moments; masters; the step count (the AdamW group's bias corrections count from it).
    fn export_impl(&self) -> StateByRole {
        let muon = self.muon.iter().map(|s| {
            let roles = Roles::from([(roles::FIRST_MOMENT.to_string(), s.momentum_buffer.shallow_clone())]);
            (s.name.clone(), carry::with_master(roles, s.master.as_ref()))
        });
        let adamw = self
            .adamw
            .iter()
            .map(|s| (s.name.clone(), carry::adam_roles(&s.exp_avg, &s.exp_avg_sq, s.master.as_ref())));
        StateByRole { step: Some(self.step as u64), params: muon.chain(adamw).collect() }
    }

    /// Another optimizer's state: a matrix's first moment becomes its momentum buffer (its
    /// second moment has nowhere to go); the AdamW group takes both moments (a first alone seeds
    /// the second, see `optim_math::carry::adam_moments`); masters where this optimizer keeps
    /// one; the step count. Checked whole before anything changes.
    fn import_impl(&mut self, state: StateByRole) -> Result<Imported, PluginError> {
        let mut report = Imported { step: state.step.is_some(), ..Imported::default() };
        let step = state.step.map_or(self.step, |s| s as i64);
        let mut given: HashMap<String, Roles> = state.params.into_iter().collect();
        let mut muon = Vec::new();
        for (i, s) in self.muon.iter().enumerate() {
            let Some(mut roles) = given.remove(&s.name) else { continue };
            let buf = carry::take_role(&mut roles, roles::FIRST_MOMENT, &s.name, &s.param)?;
            if buf.is_some() {
                report.took(roles::FIRST_MOMENT);
            }
            let master = carry::take_master(&mut roles, &s.name, s.master.is_some(), &s.param, &mut report)?;
            carry::pass_rest(roles, &mut report);
            muon.push((i, buf, master));
        }
        let mut adamw = Vec::new();
        for (i, s) in self.adamw.iter().enumerate() {
            let Some(roles) = given.remove(&s.name) else { continue };
            let (keeps_master, betas) = (s.master.is_some(), self.cfg.adamw.betas);
            adamw.push((i, AdamCarry::take(roles, &s.name, &s.param, keeps_master, step, betas, &mut report)?));
        }
        carry::refuse_unknown(given.keys())?;
        let seeded = adamw.iter().filter(|(_, t)| t.seeded()).count();
        self.step = step;
        for (i, buf, master) in muon {
            let s = &mut self.muon[i];
            if let Some(b) = buf {
                s.momentum_buffer = b;
            }
            if master.is_some() {
                s.master = master;
            }
        }
        for (i, t) in adamw {
            let s = &mut self.adamw[i];
            t.apply(&mut s.exp_avg, &mut s.exp_avg_sq, &mut s.master);
        }
        report.notes.extend(carry::seeded_note(seeded));
        Ok(report)
    }
}

// Named in full: the tests (`use super::*`) drive the ABI trait, `plugin_api::Optimizer`.
impl plugin_api::OptimizerPlugin for Muon {
    fn init(&mut self, params: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        self.init_impl(params)
    }

    fn step(&mut self, lr_scale: f64) -> Result<(), PluginError> {
        self.step_impl(lr_scale)
    }

    fn base_lr(&self) -> f64 {
        self.cfg.lr
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        self.state_impl()
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        self.load_state_impl(state)
    }

    fn set_collectives(&mut self, collectives: CollectivesBox) -> Result<(), PluginError> {
        self.collectives = Some(collectives);
        Ok(())
    }

    fn export_state(&self) -> Option<StateByRole> {
        Some(self.export_impl())
    }

    fn import_state(&mut self, state: StateByRole) -> Result<Option<Imported>, PluginError> {
        self.import_impl(state).map(Some)
    }
}

/// Distributed Muon's exchange: each rank's orthogonalised parts, flattened in unit order into
/// one buffer (padded to the longest rank's), all-gathered once; then each unit reads its update
/// from its owner's buffer. Every rank derives the same layout from the shapes alone.
fn gather_updates(
    k: &mut CollectivesBox,
    units: &mut [Unit],
    slots: &[MuonSlot],
    world: usize,
) -> Result<(), PluginError> {
    let numel = |u: &Unit| u.rows * slots[u.slot].cols;
    let mut lens = vec![0i64; world];
    for u in units.iter() {
        lens[u.owner] += numel(u);
    }
    let len = lens.iter().copied().max().unwrap_or(0);
    let Some(device) = units.first().map(|u| slots[u.slot].param.device()) else { return Ok(()) };
    let rank = k.rank() as usize;
    let mut mine: Vec<Tensor> =
        units.iter().filter(|u| u.owner == rank).map(|u| u.update.as_ref().expect("owned").flatten(0, -1)).collect();
    mine.push(Tensor::zeros([len - lens[rank]], (Kind::Float, device)));
    let input = Tensor::cat(&mine, 0);
    let outputs: Vec<Tensor> = (0..world).map(|_| Tensor::empty([len], (Kind::Float, device))).collect();
    let handles: Vec<TensorHandle> = outputs.iter().map(|t| TensorHandle::new(t.shallow_clone())).collect();
    k.all_gather(handles.as_slice().into(), &TensorHandle::new(input))
        .into_result()
        .map_err(|e| PluginError::new(format!("distributed Muon: all-gather of the updates: {e}")))?;
    let mut offsets = vec![0i64; world];
    for u in units.iter_mut() {
        let n = numel(u);
        let cols = slots[u.slot].cols;
        u.update = Some(outputs[u.owner].narrow(0, offsets[u.owner], n).view([u.rows, cols]));
        offsets[u.owner] += n;
    }
    Ok(())
}

fn info() -> PluginInfo {
    PluginInfo::new(
        "muon",
        PluginKind::Optimizer,
        env!("CARGO_PKG_VERSION"),
        "Muon (torch.optim.Muon semantics) for hidden matrices, AdamW for the rest",
    )
}

fn create(config: &str, _ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let cfg = MuonConfig::from_toml(config)?;
    Ok(PluginInstance::optimizer(Muon::new(cfg)))
}

/// The section's checks are its ranges: creating the optimizer allocates nothing either way.
impl plugin_api::Section for MuonConfig {
    fn check(&self, _ctx: &HostContext) -> Result<plugin_api::describe::SectionCheck, PluginError> {
        self.validate()?;
        Ok(Default::default())
    }

    /// An fp32 momentum buffer a parameter (the AdamW group's second moment, on its few
    /// parameters, is left out), the fp32 masters and the step's fp32 gradients.
    fn memory(
        &self,
        ctx: &HostContext,
        q: plugin_api::describe::MemoryQuery,
    ) -> Result<Option<plugin_api::describe::SectionMemory>, PluginError> {
        Ok(Some(optim_math::memory::optimizer_state(ctx, q, &[("Muon momentum (fp32)", 4.0)])?))
    }
}

plugin_api::declare_plugin!(optim_muon, info, create, section = MuonConfig);

#[cfg(test)]
mod tests;
