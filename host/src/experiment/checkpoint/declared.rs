//! The weights of a checkpoint checked against what the drafter declares: every parameter's
//! name, shape and kind.

use crate::experiment::tensors;
use anyhow::{bail, Result};
use plugin_api::{
    tch::{Kind, Tensor},
    NamedTensor,
};
use std::path::Path;

/// Check `weights` (read from `file`) against what the drafter declares, `declared` (each
/// parameter's name, shape and kind, e.g. from [`declared_by`]): every declared tensor present
/// with its shape, floating-point where the parameter is, nothing else. Each refusal is one line
/// naming the file, the tensor and what was expected.
pub fn check_declared(file: &Path, weights: &[NamedTensor], declared: &[(String, Vec<i64>, Kind)]) -> Result<()> {
    let given: std::collections::HashMap<&str, Tensor> =
        weights.iter().map(|w| (w.name.as_str(), w.tensor.tensor())).collect();
    for (name, shape, kind) in declared {
        let Some(t) = given.get(name.as_str()) else {
            bail!(
                "{}: no tensor `{name}` (the drafter declares {} {shape:?})",
                file.display(),
                tensors::dtype_name(*kind)
            );
        };
        if t.size() != *shape {
            bail!("{}: tensor `{name}` has shape {:?}, the drafter declares {shape:?}", file.display(), t.size());
        }
        if tensors::is_float(*kind) != tensors::is_float(t.kind()) {
            bail!(
                "{}: tensor `{name}` is {}, the drafter declares {} (a {} dtype)",
                file.display(),
                tensors::dtype_name(t.kind()),
                tensors::dtype_name(*kind),
                if tensors::is_float(*kind) { "floating-point" } else { "non-floating-point" }
            );
        }
    }
    if let Some(w) = weights.iter().find(|w| !declared.iter().any(|(n, ..)| n == w.name.as_str())) {
        bail!("{}: tensor `{}` is not one the drafter declares", file.display(), w.name);
    }
    Ok(())
}

/// What a drafter declares: its parameters' names, shapes and kinds.
pub fn declared_by(parameters: &[NamedTensor]) -> Vec<(String, Vec<i64>, Kind)> {
    parameters.iter().map(|p| (p.name.to_string(), p.tensor.tensor().size(), p.tensor.tensor().kind())).collect()
}
