use super::*;

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

/// Fuzzing `RunConfig::from_toml` (and each plugin's parse of its section): mutated
/// configs must give `Ok` or an error naming the file, never a panic.
mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};

    /// Every host field and a few plugin fields set, so mutations reach each of them.
    const FULL: &str = r#"name = "fuzz"
seed = 7
device = "cpu"
dtype = "f32"

[train]
steps = 10
grad_accum = 2
anchors_per_seq = 8
loss_gamma = 4.0
loss_normalization = "per_micro_batch"
anchors = "before_response"
warmup_frac = 0.1
min_lr_frac = 0.1
grad_clip = 1.0
log_every = 1
checkpoint_every = 5
keep_checkpoints = 2
max_nonfinite_steps = 3
hidden_cache_mb = 16

[pipeline]
targets = ["cpu", "cuda:1"]
drafter = "cpu"
buffer_mb = 64
deterministic = true
capture = "cap"

[target]
plugin = "hf"
path = "model.gguf"
generate_batch_size = 4

[drafter]
plugin = "dflash"
num_hidden_layers = 1
block_size = 4
target_layer_ids = [1, 2]
mask_token_id = 0

[optimizer]
plugin = "adamw"
lr = 1e-3
weight_decay = 0.0

[data]
plugin = "chat"
path = "chat.jsonl"
format = "jsonl"
batch_size = 2
max_len = 64
on_error = "skip"
"#;

    const KEYS: &[&str] = &[
        "name",
        "seed",
        "device",
        "dtype",
        "steps",
        "grad_accum",
        "anchors_per_seq",
        "loss_gamma",
        "loss_normalization",
        "anchors",
        "warmup_frac",
        "min_lr_frac",
        "grad_clip",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "max_nonfinite_steps",
        "hidden_cache_mb",
        "targets",
        "drafter",
        "buffer_mb",
        "deterministic",
        "capture",
        "plugin",
        "path",
        "generate_batch_size",
        "num_hidden_layers",
        "block_size",
        "target_layer_ids",
        "mask_token_id",
        "lr",
        "weight_decay",
        "format",
        "batch_size",
        "max_len",
        "on_error",
    ];

    #[derive(Debug, Clone)]
    enum Mutation {
        /// XOR one byte (position as a share of the length).
        Flip(f64, u8),
        Truncate(f64),
        /// Insert a line before line `i % lines`.
        InsertLine(usize, String),
        DeleteLine(usize),
        DuplicateLine(usize),
        /// Every `KEYS[k] = ...` line gets this value instead.
        SetKey(usize, String),
    }

    /// TOML values, well-formed or not, of every type and none.
    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|v| v.to_string()),
            any::<u64>().prop_map(|v| v.to_string()),
            any::<f64>().prop_map(|v| format!("{v:?}")),
            prop::sample::select(vec!["nan", "inf", "-inf", "-0", "1e999", "0", "0.0", "-1.0", "1.5"])
                .prop_map(str::to_string),
            "[ -~]{0,12}".prop_map(|s| toml::Value::from(s).to_string()),
            prop::sample::select(vec!["\"../x\"", "\"a/b\"", "\"cuda:\"", "\"cuda:99999999999\"", "\"bf16\"", "\"\""])
                .prop_map(str::to_string),
            any::<bool>().prop_map(|v| v.to_string()),
            prop::collection::vec(any::<i32>(), 0..4).prop_map(|v| format!("{v:?}")),
            Just("[\"cpu\", 1, [2]]".to_string()),
            Just("{ a = 1, b = { c = \"d\" } }".to_string()),
            Just("1979-05-27T07:32:00Z".to_string()),
            "[^\n]{0,16}",
        ]
    }

    fn junk_line() -> impl Strategy<Value = String> {
        prop_oneof![
            prop::sample::select(vec![
                "[train]",
                "[[train]]",
                "[pipeline.x]",
                "[data.extra]",
                "[]",
                "[",
                "= 1",
                "x =",
                "\"k\" = 1",
                "name = \"dup\"",
                "a.b.c = 1",
                "[target]",
                "plugin = 3",
                "plugin = \"nope\"",
                "'''",
                "\"\"\"",
                "# comment",
                "\u{feff}",
                "\t",
                "steps = 1\r",
            ])
            .prop_map(str::to_string),
            (prop::sample::select(KEYS.to_vec()), value()).prop_map(|(k, v)| format!("{k} = {v}")),
            "[^\n]{0,24}",
        ]
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            (0.0..1.0f64, 1..=255u8).prop_map(|(at, x)| Mutation::Flip(at, x)),
            (0.0..1.0f64).prop_map(Mutation::Truncate),
            (any::<usize>(), junk_line()).prop_map(|(i, l)| Mutation::InsertLine(i, l)),
            any::<usize>().prop_map(Mutation::DeleteLine),
            any::<usize>().prop_map(Mutation::DuplicateLine),
            (0..KEYS.len(), value()).prop_map(|(k, v)| Mutation::SetKey(k, v)),
            (0..KEYS.len(), value()).prop_map(|(k, v)| Mutation::SetKey(k, v)),
        ]
    }

    fn apply(text: &str, mutations: &[Mutation]) -> Vec<u8> {
        let mut bytes = text.as_bytes().to_vec();
        let at = |share: f64, len: usize| ((share * len as f64) as usize).min(len.saturating_sub(1));
        for m in mutations {
            match m {
                Mutation::Flip(share, x) => {
                    if !bytes.is_empty() {
                        let i = at(*share, bytes.len());
                        bytes[i] ^= x;
                    }
                    continue;
                }
                Mutation::Truncate(share) => {
                    bytes.truncate(at(*share, bytes.len()));
                    continue;
                }
                _ => {}
            }
            let mut lines: Vec<Vec<u8>> = bytes.split(|&b| b == b'\n').map(<[u8]>::to_vec).collect();
            let n = lines.len();
            match m {
                Mutation::InsertLine(i, l) => lines.insert(i % (n + 1), l.clone().into_bytes()),
                Mutation::DeleteLine(i) => {
                    lines.remove(i % n);
                }
                Mutation::DuplicateLine(i) => {
                    let l = lines[i % n].clone();
                    lines.insert(i % n, l);
                }
                Mutation::SetKey(k, v) => {
                    let prefix = format!("{} =", KEYS[*k]);
                    for l in lines.iter_mut().filter(|l| l.starts_with(prefix.as_bytes())) {
                        *l = format!("{prefix} {v}").into_bytes();
                    }
                }
                Mutation::Flip(..) | Mutation::Truncate(_) => unreachable!("handled above"),
            }
            bytes = lines.join(&b'\n');
        }
        bytes
    }

    /// The number of cases: `DFLASH_FUZZ_CASES` or `default`.
    fn cases(default: u32) -> u32 {
        std::env::var("DFLASH_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default)
    }

    #[test]
    fn mutated_configs_parse_or_fail_naming_the_file_never_panic() {
        let path = Path::new("fuzz.toml");
        // The unmutated config is valid: mutations start from a config that parses.
        let cfg = RunConfig::from_toml(path, FULL).unwrap();
        assert_eq!((cfg.train.steps, cfg.target_devices().len(), cfg.dtype()), (10, 2, "f32"));
        let n = cases(10_000);
        let mut runner = TestRunner::new(Config { cases: n, failure_persistence: None, ..Config::default() });
        let counts = std::cell::Cell::new((0u32, 0u32));
        let registry = crate::plugins::Registry::new(&[]).unwrap();
        let ctx = plugin_api::HostContext::cpu();
        let strategy = prop::collection::vec(mutation(), 1..5);
        runner
            .run(&strategy, |mutations| {
                let bytes = apply(FULL, &mutations);
                let text = String::from_utf8_lossy(&bytes);
                let (ok, err) = counts.get();
                match RunConfig::from_toml(path, &text) {
                    Ok(cfg) => {
                        counts.set((ok + 1, err));
                        let _ = (cfg.dtype(), cfg.target_devices(), cfg.drafter_device(), cfg.pipeline.buffer_bytes());
                        toml::to_string(&cfg).unwrap();
                        // Each plugin checks its own section through the ABI; its errors are
                        // located in the text.
                        for kind in ["target", "drafter", "optimizer", "data"] {
                            let sec = cfg.section(kind);
                            let Ok(plugin) = registry.find(crate::plugins::kind_of_section(kind), &sec.plugin) else {
                                continue;
                            };
                            let res = plugin.check(&sec, &ctx);
                            if let Err(e) = res {
                                let _ = locate_plugin_error(&text, &format!("{e:#}"));
                            }
                        }
                    }
                    Err(e) => {
                        counts.set((ok, err + 1));
                        let msg = e.to_string();
                        prop_assert!(msg.starts_with("fuzz.toml"), "error does not name the file: {msg}");
                    }
                }
                Ok(())
            })
            .unwrap();
        let (ok, err) = counts.get();
        eprintln!(
            "config fuzz: {} inputs ran, no panic ({ok} parsed, {err} refused with an error naming the file)",
            ok + err
        );
        assert_eq!(ok + err, n);
    }
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
