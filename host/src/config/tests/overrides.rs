//! `--set` overrides: typed like the file, tables, a section's plugin switched, paths.

use super::*;

#[test]
fn overrides_are_typed_like_the_file_and_errors_name_them() {
    let with = |args: &[&str]| {
        let o: Vec<Override> = args.iter().map(|a| Override::parse_set(a).unwrap()).collect();
        RunConfig::from_toml_with(Path::new("cfg.toml"), GOOD, &o)
    };
    let cfg = with(&[
        "train.steps=400",
        "optimizer.lr=1e-3",
        "name=run-2",
        "pipeline.targets=[\"cpu\", \"cpu\"]",
        "data.fields.role=who",
    ])
    .unwrap();
    assert_eq!((cfg.train.steps, cfg.name.as_str(), cfg.target_devices().len()), (400, "run-2", 2));
    assert_eq!(cfg.section("optimizer").config_toml.trim(), "lr = 0.001");
    assert_eq!(cfg.data["fields"]["role"].as_str(), Some("who"));
    // The resolved config (what the experiment records) holds the overrides.
    assert!(toml::to_string(&cfg).unwrap().contains("steps = 400"));
    for (args, want) in [
        (&["train.steps=many"][..], "--set train.steps=many: field `train.steps`: invalid type"),
        (&["train.stepz=1"][..], "--set train.stepz=1: field `train.stepz`: unknown field `stepz`"),
        (&["train.steps=0"][..], "--set train.steps=0: field `train.steps`: out of range"),
        (&["optimizer.lr=1", "train.steps.x=1"][..], "--set train.steps.x=1: field `train.steps` is not a section"),
    ] {
        let e = with(args).unwrap_err().to_string();
        assert!(e.starts_with(want), "{args:?}: {e}");
    }
    let e =
        RunConfig::from_toml_with(Path::new("cfg.toml"), GOOD, &[Override::device("cuda:x")]).unwrap_err().to_string();
    assert!(e.starts_with("--device cuda:x: field `device`"), "{e}");
    assert_eq!(
        RunConfig::from_toml_with(Path::new("cfg.toml"), GOOD, &[Override::device("cuda")]).unwrap().device,
        "cuda:0"
    );
    assert!(Override::parse_set("steps").is_err() && Override::parse_set("a..b=1").is_err());
    // The file's own mistake keeps its line though an override is given.
    let e = RunConfig::from_toml_with(
        Path::new("cfg.toml"),
        &GOOD.replace("steps = 3", "steps = \"x\""),
        &[Override::device("cpu")],
    );
    assert!(e.unwrap_err().to_string().starts_with("cfg.toml:4:"));
}

/// `--set 'train={steps=7}'` sets the fields it lists and keeps the section's others, as
/// `--set train.steps=7` would; a table for a key that holds none yet (`data.template_kwargs`)
/// is set as given, a second one adds its fields, and a value that is no table replaces what is
/// there.
#[test]
fn a_table_given_to_set_sets_the_fields_it_lists() {
    let text = GOOD.replace("steps = 3", "steps = 3\nlog_every = 5");
    let o = |a: &str| Override::parse_set(a).unwrap();
    let cfg = RunConfig::from_toml_with(Path::new("cfg.toml"), &text, &[o("train={steps=7}")]).unwrap();
    assert_eq!((cfg.train.steps, cfg.train.log_every), (7, 5));
    let cfg = RunConfig::from_toml_with(
        Path::new("cfg.toml"),
        &text,
        &[
            o("data.template_kwargs={enable_thinking=false}"),
            o("data.template_kwargs={b=2}"),
            o("pipeline.targets=[\"cpu\"]"),
        ],
    )
    .unwrap();
    assert_eq!(cfg.data["template_kwargs"]["enable_thinking"].as_bool(), Some(false));
    assert_eq!(cfg.data["template_kwargs"]["b"].as_integer(), Some(2));
    assert_eq!((cfg.train.steps, cfg.train.log_every), (3, 5));
    assert_eq!(cfg.pipeline.targets, ["cpu"]);
    assert!(cfg.switches.is_empty());
}

/// A plugin section switched to another plugin drops the old plugin's fields, keeps `lr` and
/// `weight_decay` unless set, and records the switch; a table with `plugin` switches too and then
/// sets its fields; naming the same plugin changes nothing.
#[test]
fn switching_a_sections_plugin_drops_the_old_plugins_fields_and_keeps_lr() {
    let text = GOOD.replace(
        "plugin = \"adamw\"\nlr = 1e-3",
        "plugin = \"muon\"\nlr = 3e-3\nweight_decay = 0.0\nmomentum = 0.9\nadamw = { lr = 3e-3, betas = [0.9, 0.999] }",
    );
    let o = |a: &str| Override::parse_set(a).unwrap();
    let load = |args: &[&str]| {
        RunConfig::from_toml_with(Path::new("cfg.toml"), &text, &args.iter().map(|a| o(a)).collect::<Vec<_>>()).unwrap()
    };
    let cfg = load(&["optimizer.plugin=adamw"]);
    assert_eq!(cfg.optimizer, toml::from_str("plugin = \"adamw\"\nlr = 3e-3\nweight_decay = 0.0").unwrap());
    assert_eq!(cfg.switches, [PluginSwitch { section: "optimizer".into(), from: "muon".into(), to: "adamw".into() }]);
    // A field set after the switch (or before it: the switch keeps it only if it is kept) wins.
    let cfg = load(&["optimizer.plugin=adamw", "optimizer.lr=1e-2", "optimizer.betas=[0.9, 0.95]"]);
    assert_eq!(cfg.optimizer["lr"].as_float(), Some(1e-2));
    assert_eq!(cfg.optimizer["betas"].as_array().map(Vec::len), Some(2));
    let cfg = load(&["optimizer={plugin=\"adamw\", eps=1e-6}"]);
    assert_eq!(cfg.optimizer, toml::from_str("plugin = \"adamw\"\nlr = 3e-3\nweight_decay = 0.0\neps = 1e-6").unwrap());
    // The same plugin: a table merges into the section.
    let cfg = load(&["optimizer={plugin=\"muon\", adamw={betas=[0.9, 0.95]}}"]);
    assert_eq!(cfg.optimizer["momentum"].as_float(), Some(0.9));
    assert_eq!(cfg.optimizer["adamw"]["lr"].as_float(), Some(3e-3));
    assert!(cfg.switches.is_empty());
}

/// An integer TOML cannot hold is out of range, naming the field and the bound, never a string
/// ("invalid type: string").
#[test]
fn an_integer_too_large_for_toml_is_out_of_range() {
    for (arg, want) in [
        ("train.steps=18446744073709551615", "--set train.steps=18446744073709551615: field `train.steps`: out of range: 18446744073709551615 (a config integer is at most 9223372036854775807)"),
        ("seed=-99999999999999999999", "--set seed=-99999999999999999999: field `seed`: out of range: -99999999999999999999 (a config integer is at least -9223372036854775808)"),
        ("data.max_len=0x1_0000_0000_0000_0000", "field `data.max_len`: out of range"),
    ] {
        let e = Override::parse_set(arg).unwrap_err().to_string();
        assert!(e.starts_with(want) || e.contains(want), "{arg}: {e}");
    }
    assert_eq!(Override::parse_set("train.steps=9223372036854775807").unwrap().value.as_integer(), Some(i64::MAX));
    for text in ["12ab", "1.5.3", "v2", "0xZZ", "-"] {
        assert!(Override::parse_set(&format!("name={text}")).unwrap().value.is_str(), "{text}");
    }
}

/// A relative path on the command line is against the working folder (made absolute, so the
/// experiment records where it pointed); hub names, `chatml`, `$DFLASH_CACHE/...`, absolute
/// paths and values that name nothing stay as typed.
#[test]
fn command_line_paths_are_against_the_working_folder() {
    let cwd = tempfile::tempdir().unwrap();
    std::fs::write(cwd.path().join("here.jsonl"), "").unwrap();
    let resolved = |arg: &str| {
        let mut o = Override::parse_set(arg).unwrap();
        o.resolve_paths(cwd.path());
        o.value
    };
    let abs = |p: &str| toml::Value::String(cwd.path().join(p).display().to_string());
    let same = |v: &str| toml::Value::String(v.into());
    assert_eq!(resolved("data.path=here.jsonl"), abs("here.jsonl"));
    assert_eq!(resolved("data.path=sub/missing.jsonl"), abs("sub/missing.jsonl"), "a path field, though missing");
    assert_eq!(resolved("drafter.init_from=old-drafter"), abs("old-drafter"));
    assert_eq!(resolved("data.my_file=here.jsonl"), abs("here.jsonl"), "any field naming something here");
    assert_eq!(
        resolved("data={path=\"here.jsonl\"}"),
        toml::Value::Table([("path".to_string(), abs("here.jsonl"))].into_iter().collect())
    );
    assert_eq!(resolved("target.path=Qwen/Qwen3-8B"), same("Qwen/Qwen3-8B"));
    assert_eq!(resolved("data.chat_template=chatml"), same("chatml"));
    assert_eq!(resolved("data.format=jsonl"), same("jsonl"));
    assert_eq!(resolved("data.path=$DFLASH_CACHE/chitchat.json"), same("$DFLASH_CACHE/chitchat.json"));
    assert_eq!(resolved("data.path=/abs/x.jsonl"), same("/abs/x.jsonl"));
    assert_eq!(resolved("name=here.jsonl"), same("here.jsonl"), "not a plugin section");
}
