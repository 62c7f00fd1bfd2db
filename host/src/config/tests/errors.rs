//! Errors that name the file, the line and the field: unknown fields with the closest known one,
//! wrong types, values out of range, files that are not configs.

use super::*;

#[test]
fn unknown_field_is_named_with_its_line() {
    let text = GOOD.replace("steps = 3", "steps = 3\nstepz = 4");
    let err = parse(&text).unwrap_err().to_string();
    assert!(err.contains("cfg.toml:5:") && err.contains("unknown field `stepz`"), "{err}");
}

/// A misspelt field of the host's own sections, in the file or set by `--set`, is named with
/// the one meant (from the sections' description) and where it was written.
#[test]
fn unknown_host_fields_are_named_with_the_closest_known_one() {
    let text = GOOD.replace("steps = 3", "steps = 3\nstepz = 4");
    let err = RunConfig::from_toml(Path::new("cfg.toml"), &text).unwrap_err().to_string();
    assert_eq!(err, "cfg.toml:5: field `train.stepz`: unknown field `stepz`, did you mean `steps`?");
    let err = RunConfig::from_toml(Path::new("cfg.toml"), &GOOD.replace("name = \"t\"", "name = \"t\"\nsed = 1"))
        .unwrap_err()
        .to_string();
    assert_eq!(err, "cfg.toml:3: field `sed`: unknown field `sed`, did you mean `seed`?");
    let set = [Override::parse_set("pipeline.captur=x").unwrap()];
    let err = RunConfig::from_toml_with(Path::new("cfg.toml"), GOOD, &set).unwrap_err().to_string();
    assert_eq!(
        err,
        "--set pipeline.captur=x: field `pipeline.captur`: unknown field `captur`, did you mean `capture`?"
    );
}

/// A plugin section's fields against its plugin's description (ABI `describe`): a table within
/// it and each table of an array of them are walked; a table the plugin types as free-form is not.
#[test]
fn unknown_plugin_fields_are_named_with_the_closest_known_one() {
    let registry = crate::plugins::Registry::new(&[]).unwrap();
    let doc = |kind, name| registry.find(kind, name).unwrap().describe().unwrap().unwrap();
    let muon = doc(plugin_api::PluginKind::Optimizer, "muon");
    let table = |text: &str| -> toml::Table { toml::from_str(text).unwrap() };
    let unknown = |doc, text: &str| preflight::unknown_field(doc, &table(text));
    assert_eq!(unknown(&muon, "plugin = \"muon\"\nlr = 0.02\n[adamw]\nlr = 1e-3"), None);
    assert_eq!(unknown(&muon, "lrr = 0.02").as_deref(), Some("unknown field `lrr`, did you mean `lr`?"));
    assert_eq!(
        unknown(&muon, "[adamw]\nbetaz = [0.9, 0.9]").as_deref(),
        Some("unknown field `betaz`, did you mean `betas`?")
    );
    assert_eq!(
        unknown(&muon, "[[split]]\npattern = \"*\"\nparts = [1]\n[[split]]\npatern = \"*\"").as_deref(),
        Some("unknown field `patern`, did you mean `pattern`?")
    );
    let chat = doc(plugin_api::PluginKind::DataLoader, "chat");
    assert_eq!(unknown(&chat, "path = \"d\"\n[template_kwargs]\nanything = true"), None);
    assert!(unknown(&chat, "zzzzzzzz = 1").unwrap().starts_with("unknown field `zzzzzzzz` (fields: path, format, "));
}

#[test]
fn wrong_type_and_out_of_range_are_named() {
    let err = parse(&GOOD.replace("steps = 3", "steps = \"many\"")).unwrap_err().to_string();
    assert!(err.contains("cfg.toml:4:") && err.contains("invalid type"), "{err}");
    let err = parse(&GOOD.replace("steps = 3", "steps = 3\nwarmup_frac = 1.5")).unwrap_err().to_string();
    assert!(err.contains("train.warmup_frac") && err.contains("1.5"), "{err}");
    // Validation needs the target online: a capture has no features for it.
    let eval = GOOD.replace("steps = 3", "steps = 3\neval_every = 5");
    parse(&eval).unwrap();
    let err = parse(&format!("{eval}[pipeline]\ncapture = \"features\"\n")).unwrap_err().to_string();
    assert!(err.starts_with("field `train.eval_every`: needs the target online"), "{err}");
}

#[test]
fn missing_plugin_name_and_bad_experiment_names_are_refused() {
    let err = parse(&GOOD.replace("plugin = \"adamw\"\n", "")).unwrap_err().to_string();
    assert!(err.contains("[optimizer]") && err.contains("plugin"), "{err}");
    for bad in ["../x", "a/b", "..", ".hidden", ""] {
        assert!(validate_name(bad).is_err(), "{bad}");
    }
    validate_name("smollm2-chitchat_v1.2").unwrap();
}

#[test]
fn a_missing_or_non_utf8_config_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.toml");
    let err = format!("{:#}", RunConfig::load(&missing).unwrap_err());
    assert!(err.contains("nope.toml: no such file"), "{err}");
    let bad = dir.path().join("latin1.toml");
    std::fs::write(&bad, b"name = \"caf\xe9\"\n").unwrap();
    let err = format!("{:#}", RunConfig::load(&bad).unwrap_err());
    assert!(err.contains("latin1.toml") && err.contains("UTF-8"), "{err}");
}

#[test]
fn wrong_types_in_nested_sections_name_the_line() {
    let text = GOOD.replace("steps = 3", "steps = 3\n[pipeline]\ntargets = \"cuda:0\"");
    let err = parse(&text).unwrap_err().to_string();
    assert!(err.contains("cfg.toml:6:") && err.contains("invalid type"), "{err}");
    let err = parse(&GOOD.replace("name = \"t\"", "name = 5")).unwrap_err().to_string();
    assert!(err.contains("cfg.toml:2:") && err.contains("invalid type"), "{err}");
    let err = parse(&GOOD.replace("name = \"t\"\n", "")).unwrap_err().to_string();
    assert!(err.contains("missing field `name`"), "{err}");
}

#[test]
fn mib_sizes_that_would_wrap_are_out_of_range() {
    // 2^44 MiB << 20 is 2^64: the byte count would wrap to 0.
    let text = GOOD.replace("steps = 3", "steps = 3\n[pipeline]\nbuffer_mb = 17592186044416");
    let err = parse(&text).unwrap_err().to_string();
    assert!(err.contains("pipeline.buffer_mb") && err.contains("17592186044416"), "{err}");
    let text = GOOD.replace("steps = 3", "steps = 3\nhidden_cache_mb = 17592186044416");
    let err = parse(&text).unwrap_err().to_string();
    assert!(err.contains("train.hidden_cache_mb"), "{err}");
    parse(&GOOD.replace("steps = 3", "steps = 3\nhidden_cache_mb = 0")).unwrap();
}

#[test]
fn step_counts_that_would_wrap_are_out_of_range() {
    // 2^63 steps x 2 micro-batches wrapped to 0 micro-batches: "pipeline ended before step 1".
    let text = GOOD.replace("steps = 3", "steps = 9223372036854775807\ngrad_accum = 2");
    let err = parse(&text).unwrap_err().to_string();
    assert!(err.contains("train.steps") && err.contains("9223372036854775807"), "{err}");
    let text = GOOD.replace("steps = 3", "steps = 1099511627776\ngrad_accum = 2");
    let err = parse(&text).unwrap_err().to_string();
    assert!(err.contains("train.grad_accum") && err.contains("steps x grad_accum"), "{err}");
    parse(&GOOD.replace("steps = 3", "steps = 549755813888\ngrad_accum = 2")).unwrap();
}

#[test]
fn a_fifo_or_device_as_config_is_refused_without_blocking() {
    let err = format!("{:#}", RunConfig::load(Path::new("/dev/zero")).unwrap_err());
    assert!(err.contains("/dev/zero: not a regular file (a character device)"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.toml");
    std::fs::write(&big, vec![b'#'; (MAX_CONFIG_BYTES + 1) as usize]).unwrap();
    let err = format!("{:#}", RunConfig::load(&big).unwrap_err());
    assert!(err.contains("big.toml") && err.contains("more than the 1048576 bytes allowed"), "{err}");
}

#[test]
fn experiment_names_that_could_leave_experiments_are_refused() {
    for bad in ["a/b", "/abs", "a\\b", "..", "../up", "x/../y", ".", ".hidden", "a b", "nul\0", "é", ""] {
        let text = GOOD.replace("name = \"t\"", &format!("name = {}", toml::Value::from(bad)));
        let err = parse(&text).unwrap_err().to_string();
        assert!(err.contains("field `name`") && err.contains("not a valid experiment name"), "{bad:?}: {err}");
    }
    let long = "x".repeat(129);
    assert!(validate_name(&long).is_err());
    for ok in ["t", "run-1", "a.b_c", "x".repeat(128).as_str()] {
        validate_name(ok).unwrap();
    }
}

#[test]
fn keys_are_located_in_their_section() {
    assert_eq!(locate_key(GOOD, "optimizer", "lr"), Some(12));
    assert_eq!(locate_key(GOOD, "target", "lr"), None);
    let msg = "[optimizer] plugin `adamw`: field `lr`: must be > 0, got -1";
    assert_eq!(locate_plugin_error(GOOD, msg), Some(12));
    let msg = "[data] plugin `chat`: unknown field `pth`, expected one of `path`";
    assert_eq!(locate_plugin_error(GOOD, msg), Some(13));
}
