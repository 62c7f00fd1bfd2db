//! The drafter sections of the hybrid and MoE bench configs resolved against their targets' specs
//! (read by the hf plugin from the configs alone, no weights): the attention shape they ask for
//! and the target layers the drafter reads.

use std::path::Path;

#[test]
fn the_bench_drafters_fit_their_targets() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/bench");
    for (name, heads, layer_ids) in
        [("qwen3.6-27b.toml", (32, 8, 128), Some(vec![1, 16, 31, 46, 61])), ("qwen3-30b-a3b.toml", (32, 4, 128), None)]
    {
        let cfg: toml::Table = toml::from_str(&std::fs::read_to_string(dir.join(name)).unwrap()).unwrap();
        let target_path = cfg["target"]["path"].as_str().unwrap();
        let target = target_hf::config::DecoderConfig::read(&dir.join(target_path)).unwrap();
        let spec = target.target_spec().unwrap();
        let mut drafter = cfg["drafter"].as_table().unwrap().clone();
        drafter.remove("plugin");
        let section: drafter_dflash::DrafterSection = toml::from_str(&toml::to_string(&drafter).unwrap()).unwrap();
        let d = section.resolve(&spec).unwrap();
        assert_eq!((d.num_attention_heads, d.num_key_value_heads, d.head_dim), heads, "{name}");
        if let Some(ids) = layer_ids {
            assert_eq!(d.dflash_config.target_layer_ids, ids, "{name}");
            assert_eq!((target.rotary_dim(), target.rope_theta), (64, 1e7), "{name}");
        }
    }
}
