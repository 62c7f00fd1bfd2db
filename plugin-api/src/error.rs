//! The one error type that crosses the ABI.

use abi_stable::{std_types::RString, StableAbi};
use std::fmt;

/// An error reported by a plugin: a message that already carries its context (field, file,
/// tensor name, shape). The host adds which plugin and which call.
#[repr(C)]
#[derive(StableAbi, Debug, Clone, PartialEq)]
pub struct PluginError {
    pub message: RString,
}

impl PluginError {
    pub fn new(message: impl fmt::Display) -> Self {
        Self { message: message.to_string().into() }
    }

    /// Prefix the message with context, outermost first: `ctx: message`.
    pub fn context(self, ctx: impl fmt::Display) -> Self {
        Self::new(format!("{ctx}: {}", self.message))
    }
}

impl fmt::Display for PluginError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PluginError {}

impl From<tch::TchError> for PluginError {
    fn from(e: tch::TchError) -> Self {
        Self::new(format!("libtorch: {e}"))
    }
}

/// `Result` with [`PluginError`], for code inside plugins (convert with `.into()` at the ABI).
pub type PResult<T> = Result<T, PluginError>;
