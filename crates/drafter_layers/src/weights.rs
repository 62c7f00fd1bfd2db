//! A drafter's parameters by checkpoint name, and loading them back.

use plugin_api::{
    abi_stable::std_types::RVec,
    tch::{nn, Tensor},
    NamedTensor, PluginError,
};

/// Every variable of `vs`, sorted by name (handles share storage with the model).
pub fn named_parameters(vs: &nn::VarStore) -> RVec<NamedTensor> {
    let mut vars: Vec<_> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    vars.into_iter().map(|(name, t)| NamedTensor::new(name, t)).collect()
}

/// Copy `weights` into `vs` by name: every variable must be given, with its shape, and nothing
/// else; errors name the tensor.
pub fn load_named(vs: &nn::VarStore, weights: RVec<NamedTensor>) -> Result<(), PluginError> {
    let mut given: std::collections::HashMap<String, Tensor> =
        weights.into_iter().map(|nt| (nt.name.into_string(), nt.tensor.into_tensor())).collect();
    let _guard = plugin_api::tch::no_grad_guard();
    for (name, mut var) in vs.variables() {
        let src =
            given.remove(&name).ok_or_else(|| PluginError::new(format!("drafter weights: missing tensor `{name}`")))?;
        if src.size() != var.size() {
            return Err(PluginError::new(format!(
                "drafter weights: tensor `{name}` has shape {:?}, expected {:?}",
                src.size(),
                var.size()
            )));
        }
        var.f_copy_(&src.to_kind(var.kind()).to_device(var.device()))?;
    }
    if let Some(extra) = given.keys().next() {
        return Err(PluginError::new(format!("drafter weights: unexpected tensor `{extra}`")));
    }
    Ok(())
}
