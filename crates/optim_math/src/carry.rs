//! Carrying optimizer state across optimizers (a fork's `optimizer_state = "carry"`): reading
//! the roles of [`plugin_api::roles`] back into an optimizer's own state.

use plugin_api::{
    roles::{FIRST_MOMENT, MASTER_WEIGHTS, SECOND_MOMENT},
    tch::{Kind, Tensor},
    Imported, PluginError,
};
use std::collections::BTreeMap;

/// One parameter's state by role, as [`plugin_api::StateByRole`] holds it.
pub type Roles = BTreeMap<String, Tensor>;

/// One parameter's exported state: `roles`, and its master weights when it keeps one (views of
/// the live state: an importer copies what it takes).
pub fn with_master(mut roles: Roles, master: Option<&Tensor>) -> Roles {
    if let Some(m) = master {
        roles.insert(MASTER_WEIGHTS.into(), m.shallow_clone());
    }
    roles
}

/// An AdamW-style slot's exported state (AdamW's own, Muon's AdamW group): both moments, and
/// its master weights when it keeps one.
pub fn adam_roles(exp_avg: &Tensor, exp_avg_sq: &Tensor, master: Option<&Tensor>) -> Roles {
    let moments = Roles::from([
        (FIRST_MOMENT.to_string(), exp_avg.shallow_clone()),
        (SECOND_MOMENT.to_string(), exp_avg_sq.shallow_clone()),
    ]);
    with_master(moments, master)
}

/// Take `role` out of `roles`, checked against the parameter `like` (its shape), as an fp32 copy
/// on its device: the tensors given may be another optimizer's live state.
pub fn take_role(roles: &mut Roles, role: &str, param: &str, like: &Tensor) -> Result<Option<Tensor>, PluginError> {
    let Some(t) = roles.remove(role) else { return Ok(None) };
    if t.size() != like.size() {
        return Err(PluginError::new(format!(
            "carried state of `{param}`: `{role}` has shape {:?}, the parameter {:?}",
            t.size(),
            like.size()
        )));
    }
    let _guard = plugin_api::tch::no_grad_guard();
    Ok(Some(t.to_device(like.device()).to_kind(Kind::Float).copy().contiguous()))
}

/// AdamW's `exp_avg` and `exp_avg_sq` for one parameter from its carried roles, or None when
/// neither moment is there. A first moment without a second (Muon's momentum of a matrix) seeds
/// the second as its square, bias corrections at `step` included: the smallest second moment the
/// first allows, so the next steps move each weight by about lr, as AdamW's first step does (a
/// zero second moment would divide by eps). Returns whether it seeded.
pub fn adam_moments(
    roles: &mut Roles,
    param: &str,
    like: &Tensor,
    step: i64,
    betas: [f64; 2],
    report: &mut Imported,
) -> Result<Option<(Tensor, Tensor, bool)>, PluginError> {
    let m = take_role(roles, FIRST_MOMENT, param, like)?;
    let v = take_role(roles, SECOND_MOMENT, param, like)?;
    let zeros = || Tensor::zeros(like.size(), (Kind::Float, like.device()));
    for (role, t) in [(FIRST_MOMENT, &m), (SECOND_MOMENT, &v)] {
        if t.is_some() {
            report.took(role);
        }
    }
    Ok(match (m, v) {
        (None, None) => None,
        (Some(m), Some(v)) => Some((m, v, false)),
        (None, Some(v)) => Some((zeros(), v, false)),
        (Some(m), None) => {
            let [b1, b2] = betas;
            let scale =
                if step > 0 { (1.0 - b2.powi(step as i32)) / (1.0 - b1.powi(step as i32)).powi(2) } else { 1.0 };
            let v = m.square() * scale;
            Some((m, v, true))
        }
    })
}

/// The master weights carried for a parameter, when this optimizer keeps one for it (`keeps`).
pub fn take_master(
    roles: &mut Roles,
    param: &str,
    keeps: bool,
    like: &Tensor,
    report: &mut Imported,
) -> Result<Option<Tensor>, PluginError> {
    if !keeps {
        return Ok(None);
    }
    let master = take_role(roles, MASTER_WEIGHTS, param, like)?;
    if master.is_some() {
        report.took(MASTER_WEIGHTS);
    }
    Ok(master)
}

/// What an AdamW-style slot (AdamW's own, Muon's AdamW group) takes from its carried roles.
pub struct AdamCarry {
    /// `exp_avg`, `exp_avg_sq`, and whether the second was seeded from the first.
    pub moments: Option<(Tensor, Tensor, bool)>,
    pub master: Option<Tensor>,
}

impl AdamCarry {
    /// The moments ([`adam_moments`]) and master ([`take_master`]) of one parameter; the roles
    /// left over are reported passed.
    pub fn take(
        mut roles: Roles,
        param: &str,
        like: &Tensor,
        keeps_master: bool,
        step: i64,
        betas: [f64; 2],
        report: &mut Imported,
    ) -> Result<Self, PluginError> {
        let moments = adam_moments(&mut roles, param, like, step, betas, report)?;
        let master = take_master(&mut roles, param, keeps_master, like, report)?;
        pass_rest(roles, report);
        Ok(Self { moments, master })
    }

    pub fn seeded(&self) -> bool {
        self.moments.as_ref().is_some_and(|m| m.2)
    }

    /// Into the slot's own state.
    pub fn apply(self, exp_avg: &mut Tensor, exp_avg_sq: &mut Tensor, master: &mut Option<Tensor>) {
        if let Some((m, v, _)) = self.moments {
            (*exp_avg, *exp_avg_sq) = (m, v);
        }
        if self.master.is_some() {
            *master = self.master;
        }
    }
}

/// An error for the first carried parameter (by name) this optimizer has none of.
pub fn refuse_unknown<'a>(left: impl Iterator<Item = &'a String>) -> Result<(), PluginError> {
    match left.min() {
        Some(name) => {
            Err(PluginError::new(format!("carried state names `{name}`, which is not a parameter of this optimizer")))
        }
        None => Ok(()),
    }
}

/// The note an import adds for the parameters whose second moment it seeded.
pub fn seeded_note(n: usize) -> Option<String> {
    (n > 0).then(|| format!("{SECOND_MOMENT} seeded from {FIRST_MOMENT} for {n} parameters"))
}

/// Whatever roles are left for a parameter: given, not taken.
pub fn pass_rest(roles: Roles, report: &mut Imported) {
    for role in roles.keys() {
        report.passed(role);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A first moment alone seeds the second so that the bias-corrected ratio m̂/sqrt(v̂) is ±1.
    #[test]
    fn a_first_moment_alone_seeds_the_second_to_a_unit_ratio() {
        let m = Tensor::from_slice(&[0.5f32, -0.25, 2.0]);
        let mut roles = Roles::from([(FIRST_MOMENT.to_string(), m.copy())]);
        let mut report = Imported::default();
        let (step, betas) = (7, [0.9, 0.999]);
        let (m2, v, seeded) = adam_moments(&mut roles, "w", &m, step, betas, &mut report).unwrap().unwrap();
        assert!(seeded && roles.is_empty());
        let m_hat = &m2 / (1.0 - 0.9f64.powi(7));
        let v_hat = &v / (1.0 - 0.999f64.powi(7));
        let ratio = Vec::<f32>::try_from(m_hat / v_hat.sqrt()).unwrap();
        for (r, want) in ratio.iter().zip([1.0, -1.0, 1.0]) {
            assert!((r - want).abs() < 1e-5, "{ratio:?}");
        }
        assert_eq!(report.used.get(FIRST_MOMENT), Some(&1));
        assert_eq!(report.used.get(SECOND_MOMENT), None);
    }

    #[test]
    fn a_misshapen_role_is_an_error_naming_the_parameter_and_role() {
        let mut roles =
            Roles::from([(SECOND_MOMENT.to_string(), Tensor::zeros([2], (Kind::Float, plugin_api::tch::Device::Cpu)))]);
        let like = Tensor::zeros([3], (Kind::Float, plugin_api::tch::Device::Cpu));
        let e = adam_moments(&mut roles, "norm.weight", &like, 1, [0.9, 0.999], &mut Imported::default()).unwrap_err();
        assert_eq!(e.to_string(), "carried state of `norm.weight`: `second_moment` has shape [2], the parameter [3]");
    }
}
