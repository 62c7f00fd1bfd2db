//! What DFlash drafter plugins share. A drafter plugin cannot depend on another drafter plugin:
//! that crate's rlib carries its own `dflash_plugin_*` entry symbol, which would end up in the
//! dependent plugin's library. So the shared parts live here, in a plain library:
//! - `layers`: RMSNorm, RoPE, DFlash block attention, the SwiGLU MLP (z-lab / Qwen3 weight names);
//! - `weights`: parameters by name, and loading them back with errors that name the tensor;
//! - `dflash`: the DFlash fields (block, target layers, mask token), attention layouts and
//!   saved-folder reading;
//! - `rope`: HF's `rope_scaling` kinds the drafters honour;
//! - `section`: the `[drafter]` fields every drafter has (`drafter_section!`);
//! - `shell`: the plugin around the layers (accessors, weights, building from a section or a
//!   saved folder), the same for every drafter;
//! - `target_facts`: what a drafter's config copies from its target beyond the spec;
//! - `target_layer_ids`: the DFlash paper's choice of target layers.

pub mod dflash;
pub mod layers;
pub mod rope;
pub mod section;
pub mod shell;
pub mod target_facts;
pub mod weights;

/// the DFlash paper: n target layers spread as round(1 + i * (L - 4) / (n - 1)); one layer: the middle.
pub fn target_layer_ids(num_target_layers: usize, n: usize) -> Vec<u32> {
    if n == 1 {
        return vec![(num_target_layers / 2) as u32];
    }
    let l = num_target_layers as f64;
    (0..n).map(|i| (1.0 + i as f64 * (l - 4.0) / (n as f64 - 1.0)).round() as u32).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn layer_ids_match_published_drafters() {
        // z-lab's Qwen3-8B drafter reads [1, 9, 17, 25, 33] of 36 layers.
        assert_eq!(super::target_layer_ids(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(super::target_layer_ids(64, 5), vec![1, 16, 31, 46, 61]);
        assert_eq!(super::target_layer_ids(30, 1), vec![15]);
    }
}
