use super::*;

mod errors;
mod fuzz;
mod overrides;

const GOOD: &str = r#"
name = "t"
[train]
steps = 3
[target]
plugin = "hf"
path = "x.gguf"
[drafter]
plugin = "dflash"
[optimizer]
plugin = "adamw"
lr = 1e-3
[data]
plugin = "chat"
"#;

fn parse(text: &str) -> Result<RunConfig> {
    let p = Path::new("cfg.toml");
    let cfg: RunConfig = toml::from_str(text).map_err(|e| anyhow::anyhow!("{}", toml_error(p, text, &e)))?;
    cfg.validate()?;
    Ok(cfg)
}

/// gamma is a number or "none"; the loss's normalisation and the anchor rule are named
/// choices; all three survive the resolved config.toml a run writes and resumes from.
#[test]
fn loss_settings_parse_and_round_trip() {
    let cfg = parse(GOOD).unwrap();
    let t = &cfg.train;
    assert_eq!(
        (t.loss_gamma, t.loss_normalization, t.anchors),
        (None, LossNormalization::Global, AnchorRule::Response)
    );
    let set = |lines: &str| GOOD.replace("steps = 3", &format!("steps = 3\n{lines}"));
    let cfg =
        parse(&set("loss_gamma = \"none\"\nloss_normalization = \"per_micro_batch\"\nanchors = \"before_response\""))
            .unwrap();
    let again = parse(&toml::to_string(&cfg).unwrap()).unwrap();
    for t in [&cfg.train, &again.train] {
        assert_eq!(
            (t.loss_gamma, t.loss_normalization, t.anchors),
            (Some(LossGamma::None), LossNormalization::PerMicroBatch, AnchorRule::BeforeResponse)
        );
    }
    assert_eq!(parse(&set("loss_gamma = 7")).unwrap().train.loss_gamma, Some(LossGamma::Decay(7.0)));
    for (line, want) in [
        ("loss_gamma = \"off\"", "expected a number > 0 or \"none\""),
        ("loss_gamma = 0.0", "field `train.loss_gamma`"),
        ("loss_normalization = \"mean\"", "unknown variant `mean`"),
        ("anchors = \"all\"", "unknown variant `all`"),
    ] {
        let e = parse(&set(line)).unwrap_err().to_string();
        assert!(e.contains(want), "{line}: {e}");
    }
}

#[test]
fn good_config_parses_and_splits_sections() {
    let cfg = parse(GOOD).unwrap();
    let opt = cfg.section("optimizer");
    assert_eq!(opt.plugin, "adamw");
    assert_eq!(opt.config_toml.trim(), "lr = 0.001");
    assert_eq!(cfg.dtype(), "f32");
}

#[test]
fn cuda_means_the_first_gpu() {
    let text = GOOD.replacen("name = ", "device = \"cuda\"\nname = ", 1);
    let cfg = RunConfig::from_toml(Path::new("cfg.toml"), &text).unwrap();
    assert_eq!(
        (cfg.device.as_str(), cfg.target_devices(), cfg.drafter_device()),
        ("cuda:0", vec!["cuda:0".to_string()], "cuda:0")
    );
    assert_eq!(parse_device("cuda").unwrap(), plugin_api::tch::Device::Cuda(0));
    let err =
        RunConfig::from_toml(Path::new("cfg.toml"), &text.replace("\"cuda\"", "\"gpu\"")).unwrap_err().to_string();
    assert!(err.contains("expected `cpu`, `cuda` or `cuda:N`, got `gpu`"), "{err}");
}

/// Logs name settings as the config writes them (`per_micro_batch`), never as Rust does
/// (`PerMicroBatch`): each name read back as the config value gives the same setting.
#[test]
fn settings_print_as_the_config_writes_them() {
    use super::sections::{AnchorRule, LossNormalization};
    for v in [LossNormalization::Global, LossNormalization::PerMicroBatch] {
        let back: LossNormalization = serde_json::from_value(serde_json::json!(v.to_string())).unwrap();
        assert_eq!(back, v);
    }
    for v in [AnchorRule::Response, AnchorRule::BeforeResponse] {
        let back: AnchorRule = serde_json::from_value(serde_json::json!(v.to_string())).unwrap();
        assert_eq!(back, v);
    }
    assert_eq!(LossNormalization::PerMicroBatch.to_string(), "per_micro_batch");
}
