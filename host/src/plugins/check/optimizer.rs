//! An optimizer's clauses: its state saved and restored, exported by role and imported anew,
//! zero gradients, parameters without gradients.

use super::kit::{max_diff, Clause, Kit, CPU};
use crate::plugins::handles::OptimizerHandle;
use anyhow::{anyhow, bail, Result};
use plugin_api::{
    tch::{self, Kind, Tensor},
    ExportedState, NamedTensor, ParamState, PluginInstance, PluginKind,
};

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
    fn optimizer_box(&self) -> Result<OptimizerHandle> {
        match self.create(PluginKind::Optimizer, &self.section, &self.ctx)? {
            PluginInstance::Optimizer(o) => Ok(OptimizerHandle::new(o, &self.section.plugin)),
            _ => unreachable!("Registry::create checks the kind"),
        }
    }

    pub(super) fn optimizer(&self) -> Result<Vec<Clause>> {
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
            let b_params = copy_params(&a_params);
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
            let b_params = copy_params(&a_params);
            let mut b = self.optimizer_box()?;
            b.init(named(&b_params))?;
            b.import_state(deep_copy(&first))?.ok_or_else(|| anyhow!("it exports its state but cannot import it"))?;
            let second = b.export_state()?.ok_or_else(|| anyhow!("after an import it exports nothing"))?;
            same_state(&first, &second)
        }));
        out.push(self.clause("zero gradients leave weights unchanged (but for weight decay)", || {
            let ps = params();
            let before = copy_params(&ps);
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
            let before = copy_params(&ps);
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
}

// The fixture: two matrices and a vector; fixed values, gradients from a seeded generator.

fn params() -> Vec<(String, Tensor)> {
    tch::manual_seed(1);
    ["layers.0.mlp.up_proj.weight", "layers.0.self_attn.o_proj.weight", "norm.weight"]
        .iter()
        .zip([&[8i64, 4][..], &[4, 8], &[4]])
        .map(|(n, s)| (n.to_string(), Tensor::randn(s, CPU).set_requires_grad(true)))
        .collect()
}

fn set_grads(ps: &[(String, Tensor)], seed: i64, scale: f64) {
    tch::manual_seed(seed);
    for (_, p) in ps {
        if !p.grad().defined() {
            (p * 0.0).sum(Kind::Float).backward(); // creates a (zero) .grad
        }
        p.grad().copy_(&(Tensor::randn(p.size(), CPU) * scale));
    }
}

fn named(ps: &[(String, Tensor)]) -> plugin_api::abi_stable::std_types::RVec<NamedTensor> {
    ps.iter().map(|(n, p)| NamedTensor::new(n.clone(), p.shallow_clone())).collect()
}

fn copy_params(ps: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    ps.iter().map(|(n, p)| (n.clone(), p.detach().copy().set_requires_grad(true))).collect()
}
