//! What the host reads from the machine it runs on: the asset cache, the build's revision, CUDA.

use std::path::PathBuf;

pub fn cache_dir() -> PathBuf {
    std::env::var_os("DFLASH_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/dflash"))
}

/// The git revision the binary was built from (host/build.rs), not the one of the folder it
/// runs in.
pub fn git_revision() -> &'static str {
    option_env!("DFLASH_GIT_REVISION").unwrap_or("unknown")
}

/// libtorch_cuda.so is dropped by `--as-needed`; load it before the first CUDA op.
pub fn enable_cuda() -> bool {
    kernels::load_libtorch_cuda().map_err(|e| tracing::warn!("CUDA unavailable: {e}")).is_ok()
}
