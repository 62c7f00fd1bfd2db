//! A shared library whose bytes a crate embeds (built by its build script), written to a file
//! named by its hash, so that two builds never load each other's, and opened. For the libraries
//! that link libtorch's CUDA half and so cannot be linked into binaries that must start without
//! CUDA.

use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use sha2::Digest;
use std::path::PathBuf;

/// Open `bytes` as a library (`stem` names its file in the temporary folder). It stays loaded:
/// the caller keeps the handle or forgets it.
pub fn open(bytes: &[u8], stem: &str) -> Result<Library, String> {
    let hash: String = sha2::Sha256::digest(bytes).iter().take(8).map(|b| format!("{b:02x}")).collect();
    let path: PathBuf = std::env::temp_dir().join(format!("{stem}-{hash}.so"));
    if std::fs::metadata(&path).map(|m| m.len() as usize).ok() != Some(bytes.len()) {
        let tmp = path.with_extension(format!("so.{}", std::process::id()));
        std::fs::write(&tmp, bytes)
            .and_then(|_| std::fs::rename(&tmp, &path))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    // SAFETY: a library this workspace built; its initialisers only register with libtorch.
    unsafe { Library::open(Some(&path), RTLD_NOW | RTLD_LOCAL) }.map_err(|e| format!("loading {}: {e}", path.display()))
}
