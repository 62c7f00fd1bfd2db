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
/// Halves round to even, as Python's `round` in z-lab's and SpecForge's `build_target_layer_ids`
/// does: SmolLM2's 30 layers with 5 features are [1, 8, 14, 20, 27], not [1, 8, 14, 21, 27].
pub fn target_layer_ids(num_target_layers: usize, n: usize) -> Vec<u32> {
    if n == 1 {
        return vec![(num_target_layers / 2) as u32];
    }
    let l = num_target_layers as f64;
    (0..n).map(|i| (1.0 + i as f64 * (l - 4.0) / (n as f64 - 1.0)).round_ties_even() as u32).collect()
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

    /// Values from Python's `build_target_layer_ids` (z-lab's and SpecForge's), whose `round`
    /// takes a half to the even neighbour: 7.5 -> 8 but 20.5 -> 20.
    #[test]
    fn halves_round_to_even_as_the_reference_does() {
        // SmolLM2-135M (30 layers): 1, 7.5, 14, 20.5, 27.
        assert_eq!(super::target_layer_ids(30, 5), vec![1, 8, 14, 20, 27]);
        // Gemma-2-9B (42 layers): 1, 10.5, 20, 29.5, 39.
        assert_eq!(super::target_layer_ids(42, 5), vec![1, 10, 20, 30, 39]);
        // Gemma-3-1B (26 layers): 1, 6.5, 12, 17.5, 23.
        assert_eq!(super::target_layer_ids(26, 5), vec![1, 6, 12, 18, 23]);
        // GLM-4.5-Air (46 layers): 1, 11.5, 22, 32.5, 43.
        assert_eq!(super::target_layer_ids(46, 5), vec![1, 12, 22, 32, 43]);
        // The embedded default's SmolLM2 with 3 features has no half: [1, 14, 27] either way.
        assert_eq!(super::target_layer_ids(30, 3), vec![1, 14, 27]);
    }
}
