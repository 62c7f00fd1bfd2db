//! AdamW, exactly as torch.optim.AdamW (single-tensor path) orders its operations
//!. State and update math in fp32; parameters of another dtype keep an fp32
//! master copy.

use optim_math::carry::{self, AdamCarry, Roles};
use plugin_api::{
    tch::{Kind, Tensor},
    HostContext, Imported, OptimizerPlugin, PluginError, PluginInfo, PluginInstance, PluginKind, StateByRole,
};

// The update math lives in optim_math (shared with the Muon plugin's AdamW group); re-exported so
// `optim_adamw::{ParamsAdamW, adamw_update}` keeps working.
pub use optim_math::{adamw_update, adamw_update_fused, adamw_update_master, ParamsAdamW};

struct Slot {
    name: String,
    param: Tensor,
    /// fp32 master weights when the parameter is not fp32.
    master: Option<Tensor>,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

pub struct AdamW {
    params: ParamsAdamW,
    slots: Vec<Slot>,
    step: i64,
    /// The step number on the device, for the fused kernel.
    step_on_device: Option<Tensor>,
}

impl AdamW {
    pub fn new(params: ParamsAdamW) -> Self {
        Self { params, slots: Vec::new(), step: 0, step_on_device: None }
    }

    /// Every slot with a gradient: a bf16 parameter with its master in one pass of its own
    /// (`adamw_update_master`), the rest (and those, if that kernel fails) in one fused kernel,
    /// then their masters copied back.
    fn step_fused(&mut self, lr: f64) -> Result<(), PluginError> {
        let device = self.slots[0].param.device();
        let (mut params, mut grads, mut exp_avgs, mut exp_avg_sqs, mut copy_back) =
            (vec![], vec![], vec![], vec![], vec![]);
        for s in &self.slots {
            let grad = s.param.grad();
            if !grad.defined() {
                continue;
            }
            if let Some(master) = &s.master {
                if adamw_update_master(&s.param, &grad, master, &s.exp_avg, &s.exp_avg_sq, self.step, lr, &self.params)
                {
                    continue;
                }
                copy_back.push((s.param.shallow_clone(), master.shallow_clone()));
            }
            params.push(s.master.as_ref().unwrap_or(&s.param).shallow_clone());
            grads.push(grad.to_kind(Kind::Float));
            exp_avgs.push(s.exp_avg.shallow_clone());
            exp_avg_sqs.push(s.exp_avg_sq.shallow_clone());
        }
        if !params.is_empty() {
            let step = self.step_on_device.get_or_insert_with(|| Tensor::zeros([], (Kind::Float, device)));
            let _ = step.fill_(self.step as f64);
            adamw_update_fused(&params, &grads, &exp_avgs, &exp_avg_sqs, step, lr, &self.params)?;
        }
        for (mut param, master) in copy_back {
            param.copy_(&master);
        }
        Ok(())
    }
}

impl OptimizerPlugin for AdamW {
    fn init(&mut self, params: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        self.slots = params
            .into_iter()
            .map(|(name, param)| {
                let master = (param.kind() != Kind::Float).then(|| param.detach().to_kind(Kind::Float));
                let zeros = || Tensor::zeros(param.size(), (Kind::Float, param.device()));
                Slot { name, exp_avg: zeros(), exp_avg_sq: zeros(), master, param }
            })
            .collect();
        Ok(())
    }

    fn step(&mut self, lr_scale: f64) -> Result<(), PluginError> {
        self.step += 1;
        let lr = self.params.lr * lr_scale;
        let _guard = plugin_api::tch::no_grad_guard();
        if self.params.fused && self.slots.first().is_some_and(|s| s.param.device().is_cuda()) {
            return self.step_fused(lr);
        }
        for s in &mut self.slots {
            let grad = s.param.grad();
            if !grad.defined() {
                continue; // like torch: parameters without a gradient are left alone
            }
            let grad = grad.to_kind(Kind::Float);
            match &mut s.master {
                Some(master) => {
                    adamw_update(master, &grad, &mut s.exp_avg, &mut s.exp_avg_sq, self.step, lr, &self.params);
                    s.param.copy_(master);
                }
                None => {
                    adamw_update(&mut s.param, &grad, &mut s.exp_avg, &mut s.exp_avg_sq, self.step, lr, &self.params)
                }
            }
        }
        Ok(())
    }

    fn base_lr(&self) -> f64 {
        self.params.lr
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![("step".to_string(), Tensor::from(self.step))];
        for s in &self.slots {
            out.push((format!("{}.exp_avg", s.name), s.exp_avg.shallow_clone()));
            out.push((format!("{}.exp_avg_sq", s.name), s.exp_avg_sq.shallow_clone()));
            if let Some(m) = &s.master {
                out.push((format!("{}.master", s.name), m.shallow_clone()));
            }
        }
        out
    }

    fn load_state(&mut self, state: Vec<(String, Tensor)>) -> Result<(), PluginError> {
        load_state(self, state)
    }

    fn export_state(&self) -> Option<StateByRole> {
        let roles = |s: &Slot| (s.name.clone(), carry::adam_roles(&s.exp_avg, &s.exp_avg_sq, s.master.as_ref()));
        Some(StateByRole { step: Some(self.step as u64), params: self.slots.iter().map(roles).collect() })
    }

    fn import_state(&mut self, state: StateByRole) -> Result<Option<Imported>, PluginError> {
        import_state(self, state).map(Some)
    }
}

/// Every parameter's moments (and master) from `state`, checked whole before anything changes.
fn import_state(opt: &mut AdamW, state: StateByRole) -> Result<Imported, PluginError> {
    let mut report = Imported { step: state.step.is_some(), ..Imported::default() };
    let step = state.step.map_or(opt.step, |s| s as i64);
    let mut given: std::collections::HashMap<String, Roles> = state.params.into_iter().collect();
    let mut taken = Vec::new();
    for (i, s) in opt.slots.iter().enumerate() {
        let Some(roles) = given.remove(&s.name) else { continue };
        let keeps_master = s.master.is_some();
        taken.push((i, AdamCarry::take(roles, &s.name, &s.param, keeps_master, step, opt.params.betas, &mut report)?));
    }
    carry::refuse_unknown(given.keys())?;
    let seeded = taken.iter().filter(|(_, t)| t.seeded()).count();
    opt.step = step;
    for (i, t) in taken {
        let s = &mut opt.slots[i];
        t.apply(&mut s.exp_avg, &mut s.exp_avg_sq, &mut s.master);
    }
    report.notes.extend(carry::seeded_note(seeded));
    Ok(report)
}

fn load_state(opt: &mut AdamW, state: Vec<(String, Tensor)>) -> Result<(), PluginError> {
    let mut by_name: std::collections::HashMap<String, Tensor> = state.into_iter().collect();
    let step = by_name.remove("step").ok_or_else(|| PluginError::new("optimizer state: missing `step`"))?;
    opt.step = step.int64_value(&[]);
    let mut take = |name: String, like: &Tensor| -> Result<Tensor, PluginError> {
        let t = by_name.remove(&name).ok_or_else(|| PluginError::new(format!("optimizer state: missing `{name}`")))?;
        if t.size() != like.size() {
            return Err(PluginError::new(format!(
                "optimizer state `{name}`: shape {:?}, expected {:?}",
                t.size(),
                like.size()
            )));
        }
        Ok(t.to_kind(Kind::Float).to_device(like.device()))
    };
    let _guard = plugin_api::tch::no_grad_guard();
    for s in &mut opt.slots {
        s.exp_avg = take(format!("{}.exp_avg", s.name), &s.param)?;
        s.exp_avg_sq = take(format!("{}.exp_avg_sq", s.name), &s.param)?;
        if s.master.is_some() {
            s.master = Some(take(format!("{}.master", s.name), &s.param)?);
        }
    }
    Ok(())
}

fn info() -> PluginInfo {
    PluginInfo::new(
        "adamw",
        PluginKind::Optimizer,
        env!("CARGO_PKG_VERSION"),
        "AdamW with decoupled weight decay (torch.optim.AdamW semantics)",
    )
}

fn create(config: &str, _ctx: &HostContext) -> Result<PluginInstance, PluginError> {
    let params = ParamsAdamW::from_toml(config)?;
    Ok(PluginInstance::optimizer(AdamW::new(params)))
}

// `ParamsAdamW`'s `Section` (its checks are its ranges) is optim_math's: Muon's AdamW group
// shares the type.
plugin_api::declare_plugin!(optim_adamw, info, create, section = ParamsAdamW);
