//! A plugin's record: what it is and where it came from, as the registry, the probe and the
//! manifests carry it.

use serde::Serialize;

/// What a plugin is and where it came from, for `plugins list` and manifests.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct PluginRecord {
    pub name: String,
    pub kind: String,
    pub version: String,
    pub description: String,
    /// Plugin ABI version it was built against.
    pub abi: String,
    /// `builtin` or the shared library's path.
    pub origin: String,
    pub sha256: Option<String>,
}
