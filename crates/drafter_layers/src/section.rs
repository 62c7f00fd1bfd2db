//! The `[drafter]` fields every DFlash drafter has, written once: each drafter declares its
//! section with [`drafter_section!`](crate::drafter_section), its own fields first. A macro
//! rather than `#[serde(flatten)]`, which `deny_unknown_fields` does not work with; so a typo is
//! still refused by name, and changing `plugin = "dflash"` to `"gdn"` keeps what these mean.

/// `pub struct NAME { own fields }` with the shared fields appended (`block_size`,
/// `num_target_features`, `target_layer_ids`, `mask_token_id`, `intermediate_size`,
/// `init_from`); the attributes given (derives, `serde(deny_unknown_fields)`) are kept.
#[macro_export]
macro_rules! drafter_section {
    ($(#[$meta:meta])* pub struct $name:ident { $($own:tt)* }) => {
        $(#[$meta])*
        pub struct $name {
            $($own)*
            /// Tokens per block, the anchor included (16 in the paper).
            #[describe(range = "in 2..=64")]
            #[serde(default = "drafter_layers::section::default_block_size")]
            pub block_size: usize,
            /// How many target layers feed the drafter; their ids follow the DFlash paper's formula.
            #[describe(range = ">= 1")]
            #[serde(default = "drafter_layers::section::default_num_target_features")]
            pub num_target_features: usize,
            /// Explicit target layer ids (overrides `num_target_features`).
            #[serde(default)]
            pub target_layer_ids: Option<Vec<u32>>,
            /// Token fed at the masked block positions. Default: the target's pad token when it is
            /// not its EOS token.
            #[serde(default)]
            pub mask_token_id: Option<u32>,
            /// MLP width (default: the target's).
            #[describe(range = ">= 1")]
            #[serde(default)]
            pub intermediate_size: Option<usize>,
            /// Start from a saved drafter folder of this plugin (config.json + model.safetensors:
            /// `dflash-host export` writes one; z-lab's format for `dflash`): its config replaces
            /// the other fields, its weights the random initialisation.
            #[serde(default)]
            pub init_from: Option<String>,
        }
    };
}

/// Draft layers when the section does not say (z-lab's Qwen3-8B drafter: 5).
pub fn default_num_hidden_layers() -> usize {
    5
}
pub fn default_block_size() -> usize {
    16
}
pub fn default_num_target_features() -> usize {
    5
}
