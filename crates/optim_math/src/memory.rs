//! An optimizer's device memory for the host's estimate (ABI `memory`): its per-parameter state,
//! the fp32 master copies of parameters trained in another dtype, and the step's fp32 copies of
//! the gradients (both optimizers update in fp32).

use plugin_api::{
    describe::{MemoryPart, MemoryQuery, MemoryScale, SectionMemory},
    tch::Kind,
    HostContext, PluginError,
};

/// `state`: each buffer's name and bytes a parameter.
pub fn optimizer_state(ctx: &HostContext, q: MemoryQuery, state: &[(&str, f64)]) -> Result<SectionMemory, PluginError> {
    let n = q.trained_parameters as f64;
    let mut parts: Vec<MemoryPart> =
        state.iter().map(|(name, bytes)| MemoryPart::new(name, n * bytes, MemoryScale::Fixed)).collect();
    if ctx.tch_kind()? != Kind::Float {
        parts.push(MemoryPart::new("fp32 master weights", n * 4.0, MemoryScale::Fixed));
        parts.push(MemoryPart::new("fp32 gradients in the step", n * 4.0, MemoryScale::Fixed));
    }
    Ok(SectionMemory { parts: parts.into(), ..SectionMemory::default() })
}
