//! Hostile drafter weights: a missing, misshapen or unexpected tensor is named (with both shapes),
//! and a truncated z-lab folder names the file at fault.

mod common;

use drafter_dflash::{config::DFlashConfig, read_zlab, DFlashPlugin, DrafterSection, DrafterShell};
use plugin_api::{
    abi_stable::std_types::RVec,
    tch::{Device, Kind, Tensor},
    DrafterPlugin, NamedTensor,
};

fn tiny_config() -> DFlashConfig {
    let section: DrafterSection =
        plugin_api::parse_section("num_hidden_layers = 1\nblock_size = 4\nnum_target_features = 2\nmask_token_id = 0")
            .unwrap();
    section.resolve(&common::tiny_target()).unwrap()
}

/// The drafter's own weights, as a checkpoint holds them.
fn weights(d: &DFlashPlugin) -> Vec<(String, Tensor)> {
    d.parameters().into_iter().map(|(n, t)| (n, t.detach().copy())).collect()
}

fn load(d: &mut DFlashPlugin, w: Vec<(String, Tensor)>) -> Result<(), String> {
    let named: RVec<NamedTensor> = w.into_iter().map(|(n, t)| NamedTensor::new(n, t)).collect();
    d.load(named).map_err(|e| e.to_string())
}

#[test]
fn load_weights_names_a_missing_misshapen_or_unexpected_tensor() {
    let mut d = DFlashPlugin::new(&tiny_config(), Device::Cpu, Kind::Float);
    let good = weights(&d);
    let victim = "layers.0.mlp.up_proj.weight";
    assert!(good.iter().any(|(n, _)| n == victim), "{:?}", good.iter().map(|(n, _)| n).collect::<Vec<_>>());
    let copy = |keep: &dyn Fn(&str) -> bool| -> Vec<(String, Tensor)> {
        good.iter().filter(|(n, _)| keep(n)).map(|(n, t)| (n.clone(), t.copy())).collect()
    };
    // Its own weights load back.
    load(&mut d, copy(&|_| true)).unwrap();

    let err = load(&mut d, copy(&|n| n != victim)).unwrap_err();
    assert_eq!(err, format!("drafter weights: missing tensor `{victim}`"));

    let mut misshapen = copy(&|n| n != victim);
    misshapen.push((victim.into(), Tensor::zeros([23, 16], (Kind::Float, Device::Cpu))));
    let err = load(&mut d, misshapen).unwrap_err();
    assert_eq!(err, format!("drafter weights: tensor `{victim}` has shape [23, 16], expected [24, 16]"));

    let mut extra = copy(&|_| true);
    extra.push(("layers.9.mlp.up_proj.weight".into(), Tensor::zeros([1], (Kind::Float, Device::Cpu))));
    let err = load(&mut d, extra).unwrap_err();
    assert_eq!(err, "drafter weights: unexpected tensor `layers.9.mlp.up_proj.weight`");
}

#[test]
fn a_truncated_zlab_drafter_names_the_file() {
    let d = DFlashPlugin::new(&tiny_config(), Device::Cpu, Kind::Float);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), d.config_json().as_str()).unwrap();
    let st = dir.path().join("model.safetensors");
    Tensor::write_safetensors(&weights(&d), &st).unwrap();
    let (cfg, w) = read_zlab(dir.path(), &common::tiny_target()).unwrap();
    assert_eq!((cfg, w.len()), (tiny_config(), weights(&d).len()));

    // Cut in the data, in the JSON header, inside the header's length.
    let bytes = std::fs::read(&st).unwrap();
    for cut in [bytes.len() / 2, 20, 5] {
        std::fs::write(&st, &bytes[..cut]).unwrap();
        let err = read_zlab(dir.path(), &common::tiny_target()).expect_err("a truncated file read").to_string();
        assert!(err.starts_with(&format!("{}: ", st.display())), "cut at {cut}: {err}");
    }

    std::fs::write(dir.path().join("config.json"), "{\"hidden_size\": 16,").unwrap();
    let err = read_zlab(dir.path(), &common::tiny_target()).expect_err("a truncated config read").to_string();
    assert!(err.starts_with(&format!("{}: ", dir.path().join("config.json").display())), "{err}");
}
