//! Plugins as shared libraries: an out-of-tree plugin built against plugin-api alone trains
//! without rebuilding the host; built-ins can be swapped for their .so; every way a library can
//! be wrong is refused with one line; a panic inside a plugin stops the run cleanly.

mod common;
use common::{build_plugin, root};
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

fn host() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_dflash-host"))
}

fn sha256(path: &Path) -> String {
    use sha2::{Digest, Sha256};
    format!("{:x}", Sha256::digest(std::fs::read(path).unwrap()))
}

const HEAD: &str = r#"
name = "so"
seed = 5
[train]
steps = 20
anchors_per_seq = 8
log_every = 5
checkpoint_every = 2
"#;

fn train(plugins: &[&Path], optimizer: &str) -> (Output, tempfile::TempDir) {
    common::train(plugins, &common::tiny_config(HEAD, optimizer))
}

fn error_line(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "expected exit code 2, got {:?}:\n{err}", out.status.code());
    assert!(!err.contains("panicked at") && !err.contains("stack backtrace"), "a panic escaped:\n{err}");
    err.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("no error line in:\n{err}")).to_string()
}

fn inspect(path: &Path) -> Output {
    Command::new(host()).args(["plugins", "inspect"]).arg(path).env_remove("RUST_BACKTRACE").output().unwrap()
}

#[test]
fn an_out_of_tree_plugin_trains_without_rebuilding_the_host() {
    let before = sha256(&host());
    let so = build_plugin("plugin-template", "optim_sgd", &[], "optim_sgd");
    let (out, dir) = train(&[&so], "plugin = \"sgd\"\nlr = 0.05\nmomentum = 0.9");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("exp/manifest.json")).unwrap()).unwrap();
    let sgd = manifest["plugins"].as_array().unwrap().iter().find(|p| p["name"] == "sgd").expect("sgd in manifest");
    assert_eq!(sgd["origin"], so.display().to_string());
    assert_eq!(sgd["sha256"], sha256(&so));
    let metrics = std::fs::read_to_string(dir.path().join("exp/metrics.jsonl")).unwrap();
    let losses: Vec<f64> = metrics
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect();
    assert!(losses.last().unwrap() < &(losses[0] * 0.5), "SGD did not train: {losses:?}");
    assert_eq!(sha256(&host()), before, "the host binary changed");
}

/// `dflash-host --plugin optim_adamw.so train ...` as a user types it: the bare name is found
/// beside the binary, where `make build` leaves every plugin.
#[test]
fn a_built_in_can_be_replaced_by_its_shared_library_named_bare() {
    let so = root().join("target/release/liboptim_adamw.so");
    assert!(so.exists(), "{} missing: `cargo build --release --workspace` builds it (make test does)", so.display());
    let (out, dir) = train(&[Path::new("optim_adamw.so")], "plugin = \"adamw\"\nlr = 3e-3");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("optimizer plugin `adamw` from") && err.contains("replaces the built-in"), "{err}");
    let manifest = std::fs::read_to_string(dir.path().join("exp/manifest.json")).unwrap();
    assert!(manifest.contains(&sha256(&so)));
    // The other spellings find the same library; an unknown name says where it looked.
    for name in ["optim_adamw", "liboptim_adamw.so"] {
        let out = Command::new(host()).args(["--plugin", name, "plugins", "list"]).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && stdout.contains(&so.display().to_string()), "{name}: {stdout}");
    }
    let out = Command::new(host())
        .args(["--plugin", "optim_nothing", "plugins", "list"])
        .env("DFLASH_PLUGIN_PATH", "/tmp/a:/tmp/b")
        .output()
        .unwrap();
    let line = error_line(&out);
    assert!(
        line.contains("liboptim_nothing.so")
            && line.contains("/tmp/a, /tmp/b")
            && line.contains(&root().join("target/release").display().to_string()),
        "{line}"
    );
}

#[test]
fn wrong_libraries_are_refused_in_one_line() {
    let cases: Vec<(PathBuf, &str)> = vec![
        (PathBuf::from("/no/such/plugin.so"), "no such file"),
        (root().join("target"), "is a directory"),
        (root().join("Cargo.toml"), "not a shared library"),
        (host(), "no `dflash_plugin_*` entry symbol"),
        (
            build_plugin("tests/plugins/faulty", "faulty", &["test-other-major"], "faulty-other-major"),
            "built for plugin ABI 99.0.0, this host speaks plugin ABI",
        ),
        (
            build_plugin("tests/plugins/faulty", "faulty", &["test-old-layout"], "faulty-layout"),
            "types differ from this host's",
        ),
        (
            build_plugin("tests/plugins/faulty", "faulty", &["test-other-libtorch"], "faulty-libtorch"),
            "libtorch 2.10.0",
        ),
        // An older minor version (this major's first) may lack trait methods, nothing else.
        (
            build_plugin(
                "tests/plugins/faulty",
                "faulty",
                &["test-old-layout", "test-older-minor"],
                "faulty-older-layout",
            ),
            "types differ from this host's",
        ),
    ];
    for (path, want) in cases {
        let line = error_line(&inspect(&path));
        assert!(line.contains(want) && line.contains(&path.display().to_string()), "{}: {line}", path.display());
    }
    // A good one inspects fine.
    let ok = build_plugin("tests/plugins/faulty", "faulty", &[], "faulty");
    let out = inspect(&ok);
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("faulty"));
    // Two libraries with one name.
    let out = Command::new(host())
        .args(["--plugin"])
        .arg(&ok)
        .arg("--plugin")
        .arg(&ok)
        .args(["plugins", "list"])
        .output()
        .unwrap();
    assert!(error_line(&out).contains("two optimizer plugins named `faulty`"));
    // A plugin of the wrong kind for its slot.
    let (out, _dir) = train(&[], "plugin = \"dflash\"");
    let line = error_line(&out);
    assert!(line.contains("[optimizer]") && line.contains("`dflash` is a drafter plugin"), "{line}");
}

/// `evil.c` passes every check made from its file, and its constructor runs in whatever loads it:
/// only ever the probe, which it may crash, kill with its whole process group and parent, or
/// flood with 1.5 GB of output; the host survives each with one line naming the library and how
/// its probe died, and stays small. A library whose entry symbol is a function is refused from
/// its file.
#[test]
fn inspect_and_list_never_load_a_library_into_the_host_and_a_crash_is_one_line() {
    let evil = common::build_c_library("evil");
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("loaded-by");
    let cases = [
        ("none", vec!["plugins", "inspect", evil.to_str().unwrap()], "(SIGABRT"),
        ("none", vec!["--plugin", evil.to_str().unwrap(), "plugins", "list"], "(SIGABRT"),
        ("kill", vec!["plugins", "inspect", evil.to_str().unwrap()], "(SIGKILL"),
        ("flood", vec!["plugins", "inspect", evil.to_str().unwrap()], "(SIGABRT"),
    ];
    for (mode, args, signal) in cases {
        let _ = std::fs::remove_file(&marker);
        let child = Command::new(host())
            .args(&args)
            .env("DFLASH_EVIL_MARKER", &marker)
            .env("DFLASH_EVIL_MODE", mode)
            .env_remove("RUST_BACKTRACE")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let host_pid = child.id();
        // The host's peak memory, read while it runs.
        let status = format!("/proc/{host_pid}/status");
        let watch = std::thread::spawn(move || {
            let mut peak_kb = 0u64;
            while let Ok(text) = std::fs::read_to_string(&status) {
                let hwm = text.lines().find_map(|l| l.strip_prefix("VmHWM:")).map(|v| v.trim().trim_end_matches(" kB"));
                peak_kb = peak_kb.max(hwm.and_then(|v| v.parse().ok()).unwrap_or(0));
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            peak_kb
        });
        let out = child.wait_with_output().unwrap();
        let line = error_line(&out);
        assert!(
            line.contains(&evil.display().to_string()) && line.contains(&format!("killed the probe process {signal}")),
            "{mode} {args:?}: {line}"
        );
        let loaders = std::fs::read_to_string(&marker).unwrap_or_default();
        assert!(!loaders.is_empty(), "the probe never loaded it");
        assert!(
            !loaders.lines().any(|p| p == host_pid.to_string()),
            "the host itself ran the library's constructor ({host_pid}): {loaders}"
        );
        let peak_mb = watch.join().unwrap() / 1024;
        assert!(peak_mb < 600, "{mode}: the host grew to {peak_mb} MB");
    }
    let function = common::build_c_library("evil_function");
    let line = error_line(&inspect(&function));
    assert!(line.contains("entry symbol `dflash_plugin_function` is a function, not the plugin header"), "{line}");
}

#[test]
fn a_panic_inside_a_plugin_stops_the_run_with_its_last_checkpoint() {
    let so = build_plugin("tests/plugins/faulty", "faulty", &[], "faulty");
    let (out, dir) = train(&[&so], "plugin = \"faulty\"\npanic_at_step = 5");
    let line = error_line(&out);
    assert!(
        line.contains("optimizer plugin `faulty`")
            && line.contains("step")
            && line.contains("deliberate failure at step 5"),
        "{line}"
    );
    let ckpts = dir.path().join("exp/checkpoints");
    let names: Vec<String> =
        std::fs::read_dir(&ckpts).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert!(names.contains(&"step-4".to_string()) && !names.iter().any(|n| n.starts_with("step-5")), "{names:?}");
    let weights = plugin_api::tch::Tensor::read_safetensors(ckpts.join("step-4/model.safetensors")).unwrap();
    assert!(!weights.is_empty());
}

#[test]
fn a_diverged_run_skips_then_stops_keeping_its_last_good_checkpoint() {
    let so = build_plugin("tests/plugins/faulty", "faulty", &[], "faulty");
    let head =
        HEAD.replace("checkpoint_every = 2", "checkpoint_every = 1\nmax_nonfinite_steps = 2\nkeep_checkpoints = 5");
    let (out, dir) = common::train(&[&so], &common::tiny_config(&head, "plugin = \"faulty\"\nnan_at_step = 3"));
    let line = error_line(&out);
    assert!(line.contains("2 consecutive steps with a non-finite loss") && line.contains("step-2"), "{line}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("step 3: drafter weights are not finite; checkpoint not written"), "{err}");
    let ckpts = dir.path().join("exp/checkpoints");
    let mut names: Vec<String> =
        std::fs::read_dir(&ckpts).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    names.sort();
    assert_eq!(names, ["step-1", "step-2"]);
    let metrics = std::fs::read_to_string(dir.path().join("exp/metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert!(last["skipped_steps"].as_u64().unwrap() <= 2);
}

/// A config whose `[drafter]` or `[data]` section is replaced by `section`.
fn with_section(config: &str, kind: &str, section: &str) -> String {
    let start = config.find(&format!("[{kind}]\n")).unwrap();
    let end = config[start + 1..].find("\n[").map_or(config.len(), |e| start + 2 + e);
    format!("{}[{kind}]\n{section}\n\n{}", &config[..start], &config[end..])
}

/// A panic in any plugin method is the error of that call: the run stops with one line naming
/// the plugin and the method, exit code 2, and uses nothing the call did not give. Methods that
/// return a value (the optimizer's `base_lr`, the target's `spec`, the drafter's `parameters` for
/// the first checkpoint, which is not written, the data loader's `position`) as much as the
/// drafter's `forward` and the data loader's `next_batch`.
#[test]
fn a_panic_in_any_plugin_method_is_one_line_and_exit_code_2() {
    let so = build_plugin("tests/plugins/faulty", "faulty", &[], "faulty");
    let (out, _dir) = train(&[&so], "plugin = \"faulty\"\npanic_in = \"base_lr\"");
    let line = error_line(&out);
    assert!(line.ends_with("optimizer plugin `faulty`: base_lr: panicked: deliberate panic in base_lr"), "{line}");

    let adamw = common::tiny_config(HEAD, "plugin = \"adamw\"\nlr = 3e-3");
    let drafter = build_plugin("tests/plugins/faulty_drafter", "faulty_drafter", &[], "faulty_drafter");
    let config =
        with_section(&adamw, "drafter", "plugin = \"faulty_drafter\"\npanic_in = \"parameters\"\npanic_at_call = 2");
    let (out, dir) = common::train(&[&drafter], &config);
    let line = error_line(&out);
    assert_eq!(line, "error: drafter plugin `faulty_drafter`: parameters: panicked: deliberate panic in parameters");
    let ckpts = dir.path().join("exp/checkpoints");
    assert!(!ckpts.join("step-2").exists(), "a checkpoint was written without the drafter's weights");
    let config = with_section(&adamw, "drafter", "plugin = \"faulty_drafter\"\npanic_in = \"forward\"");
    let line = error_line(&common::train(&[&drafter], &config).0);
    assert_eq!(line, "error: drafter plugin `faulty_drafter`: forward: panicked: deliberate panic in forward");

    let data = build_plugin("tests/plugins/faulty_data", "faulty_data", &[], "faulty_data");
    for (method, want) in [("position", "position: panicked"), ("next_batch", "next_batch: panicked")] {
        let config = with_section(&adamw, "data", &format!("plugin = \"faulty_data\"\npanic_in = \"{method}\""));
        // The producer stage adds `data loader: `.
        let line = error_line(&common::train(&[&data], &config).0);
        assert!(line.ends_with(&format!("data plugin `faulty_data`: {want}: deliberate panic in {method}")), "{line}");
    }

    let target = build_plugin("tests/plugins/synthetic_target", "synthetic_target", &[], "synthetic_target");
    let config = common::tiny_config(HEAD, "plugin = \"adamw\"\nlr = 3e-3").replace(
        "plugin = \"hf\"\npath = \"$DFLASH_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf\"",
        "plugin = \"synthetic\"\npanic_in = \"spec\"",
    );
    let (out, _dir) = common::train(&[&target], &config);
    let line = error_line(&out);
    assert!(line.ends_with("target plugin `synthetic`: spec: panicked: deliberate panic in spec"), "{line}");
}

/// Versioning: plugins built against the previous version of plugin-api. They come from this
/// repository's history, so nothing old is committed twice and the test follows each bump by
/// itself: plugin-api and the templates as they were just before plugin-api took its current
/// version (the first parent of the commit that bumped it, or HEAD while a bump is not committed
/// yet), each template that existed then built against that plugin-api. When that version is an
/// older minor of this major, each loads and trains 2 steps in this host (a minor version only
/// appends; a template whose kind's trait gained methods since runs them as their defaults). When
/// it is the previous major, each is refused with one line that names both versions and says to
/// rebuild, by `plugins inspect` and by `train` alike.
#[test]
fn plugins_built_against_the_previous_plugin_api_load_or_are_refused_by_major() {
    let git = |args: &[&str]| -> Vec<u8> {
        let out =
            Command::new("git").args(args).current_dir(root()).output().expect("git, to read plugin-api's history");
        assert!(out.status.success(), "git {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        out.stdout
    };
    let text = |args: &[&str]| String::from_utf8(git(args)).unwrap();
    assert_eq!(
        text(&["rev-parse", "--is-shallow-repository"]).trim(),
        "false",
        "this test builds plugin-api from history: git fetch --unshallow"
    );
    // (major, minor) of a plugin-api/Cargo.toml.
    let version = |manifest: &str| -> (u64, u64) {
        let v = manifest
            .lines()
            .find_map(|l| l.strip_prefix("version = \""))
            .map(|v| v.trim_end_matches('"'))
            .unwrap_or("0.0");
        let mut parts = v.split('.').map(|p| p.parse::<u64>().unwrap());
        (parts.next().unwrap(), parts.next().unwrap())
    };
    let now = version(&std::fs::read_to_string(root().join("plugin-api/Cargo.toml")).unwrap());
    let commits: Vec<String> = text(&["log", "--first-parent", "--format=%H", "--", "plugin-api/Cargo.toml"])
        .lines()
        .map(String::from)
        .collect();
    let at = |c: &str| version(&text(&["show", &format!("{c}:plugin-api/Cargo.toml")]));
    let i = commits.iter().position(|c| at(c) < now).expect("no earlier version of plugin-api in the history");
    let snapshot = if i == 0 { "HEAD".to_string() } else { format!("{}^1", commits[i - 1]) };
    let old = at(&snapshot);
    assert!(old < now && old.0 + 1 >= now.0, "plugin-api {old:?} at {snapshot}, {now:?} now");

    // The templates of then: folder, library, kind, plugin name, config section.
    let dir = tempfile::tempdir().unwrap();
    let data_section = format!("path = {:?}\nbatch_size = 2", ids_file(dir.path()).display().to_string());
    let templates = [
        ("plugin-template", "optim_sgd", "optimizer", "sgd", "lr = 0.05".to_string()),
        ("templates/data_ids", "data_ids", "data", "ids", data_section),
        ("templates/drafter_tiny", "drafter_tiny", "drafter", "tiny_drafter", "mask_token_id = 16".to_string()),
        ("templates/target_tiny", "target_tiny", "target", "tiny_lm", "seed = 1".to_string()),
    ];
    let then: Vec<_> = templates
        .into_iter()
        .filter(|t| {
            Command::new("git")
                .args(["cat-file", "-e", &format!("{snapshot}:{}/Cargo.toml", t.0)])
                .current_dir(root())
                .stderr(std::process::Stdio::null())
                .status()
                .unwrap()
                .success()
        })
        .collect();
    let mut paths = vec!["Cargo.toml", "plugin-api"];
    paths.extend(then.iter().map(|t| t.0));
    let tar = dir.path().join("old.tar");
    let mut archive = vec!["archive", "-o", tar.to_str().unwrap(), snapshot.as_str()];
    archive.extend(&paths);
    git(&archive);
    let old_root = dir.path().join("old");
    std::fs::create_dir(&old_root).unwrap();
    let out = Command::new("tar").arg("-xf").arg(&tar).arg("-C").arg(&old_root).output().unwrap();
    assert!(out.status.success(), "tar: {}", String::from_utf8_lossy(&out.stderr));
    // The workspace root (plugin-api inherits fields from it) reduced to plugin-api.
    let manifest = old_root.join("Cargo.toml");
    let mut ws: toml::Table = toml::from_str(&std::fs::read_to_string(&manifest).unwrap()).unwrap();
    let table = ws["workspace"].as_table_mut().unwrap();
    table.insert("members".into(), toml::Value::Array(vec!["plugin-api".into()]));
    table.remove("default-members");
    table.remove("exclude");
    std::fs::write(&manifest, toml::to_string(&ws).unwrap()).unwrap();

    let head = HEAD.replace("steps = 20", "steps = 2");
    for (folder, lib, kind, plugin, section) in then {
        // Its own library name, apart from today's template's in the shared target folder.
        let cargo_toml = old_root.join(folder).join("Cargo.toml");
        let renamed = std::fs::read_to_string(&cargo_toml).unwrap().replacen(
            &format!("name = \"{lib}\""),
            &format!("name = \"{lib}_previous\""),
            1,
        );
        std::fs::write(&cargo_toml, renamed).unwrap();
        let lib = format!("{lib}_previous");
        let so = build_plugin(old_root.join(folder).to_str().unwrap(), &lib, &[], &lib);
        let section = format!("plugin = \"{plugin}\"\n{section}");
        let config = match kind {
            "optimizer" => common::tiny_config(&head, &section),
            _ => with_section(&common::tiny_config(&head, "plugin = \"adamw\"\nlr = 3e-3"), kind, &section),
        };
        if old.0 < now.0 {
            let refused = |line: &str| {
                assert!(
                    line.contains(&so.display().to_string())
                        && line.contains(&format!("built for plugin ABI {}.{}.", old.0, old.1))
                        && line.contains(&format!("this host speaks plugin ABI {}.{}.", now.0, now.1))
                        && line.contains("rebuild the plugin against plugin-api"),
                    "{folder}: {line}"
                )
            };
            refused(&error_line(&inspect(&so)));
            refused(&error_line(&common::train(&[&so], &config).0));
            continue;
        }
        let out = inspect(&so);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!(" {}.{}.", old.0, old.1)),
            "{folder}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (out, _exp) = common::train(&[&so], &config);
        assert!(
            out.status.success(),
            "{folder} of plugin-api {old:?} in this host ({now:?}): {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn check(plugins: &[&Path], args: &[&str]) -> (Option<i32>, String) {
    let mut cmd = Command::new(host());
    for p in plugins {
        cmd.arg("--plugin").arg(p);
    }
    let out = cmd
        .args(["plugins", "check"])
        .args(args)
        .current_dir(root())
        .env("DFLASH_CACHE", common::cache())
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code(), text)
}

/// `plugins check`: every built-in passes its kind's contract; a faulty plugin fails with the
/// clause named (exit 1).
#[test]
fn the_conformance_kit_passes_the_built_ins_and_names_a_failed_clause() {
    common::require_model();
    const TINY_DATA: &str = "path = \"$DFLASH_CACHE/chitchat.json\"\nformat = \"chitchat\"\nbatch_size = 2\nmax_len = 96\nmax_records = 6\ndistill = false";
    for args in [
        &["adamw"][..],
        &["muon", "--section", "lr = 0.02"],
        &["dflash"],
        &["gdn", "--section", "num_hidden_layers = 1\nblock_size = 4\nnum_target_features = 2\nmask_token_id = 16"],
        &["hf"],
        &["chat", "--section", TINY_DATA],
    ] {
        let (code, text) = check(&[], args);
        assert_eq!(code, Some(0), "{args:?}:\n{text}");
        assert!(text.contains("clauses pass") && !text.contains("FAIL"), "{args:?}:\n{text}");
    }
    let so = build_plugin("tests/plugins/faulty", "faulty", &[], "faulty");
    let (code, text) = check(&[], &[so.to_str().unwrap(), "--section", "touch_all = true\nlossy_carry = true"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains("FAIL  state exported by role round-trips (export, import anew, export again): `layers.0.mlp.up_proj.weight` first_moment differs by 5e-1 after the round trip"),
        "{text}"
    );
    // Declared without `section = TYPE`: no description, and nothing refuses an unknown field.
    assert!(text.contains("FAIL  describes its section: every field with a type, a default and a meaning: it does not describe its section"), "{text}");
    assert!(
        text.contains("FAIL  its check refuses an unknown field, naming it: `no_such_field_zz = 1` was accepted"),
        "{text}"
    );
    assert!(text.contains("FAIL  parameters without gradients are skipped: `layers.0.self_attn.o_proj.weight` has no gradient but changed"), "{text}");
    assert!(text.contains("FAIL  zero gradients leave weights unchanged"), "{text}");
    let target = build_plugin("tests/plugins/synthetic_target", "synthetic_target", &[], "synthetic_target");
    let (code, text) = check(&[], &[target.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("pass  features of the requested layers"), "{text}");
    for clause in [
        "describes its section",
        "its check refuses an unknown field",
        "what its check says of the target is what it loads",
        "its FLOPs, where it counts them, grow with the layers and the head",
    ] {
        assert!(text.contains(&format!("pass  {clause}")), "{clause}: {text}");
    }
    let (code, text) = check(&[], &[target.to_str().unwrap(), "--section", "wrong_facts = true\nflat_flops = true"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains(
            "FAIL  what its check says of the target is what it loads: check says 5 layers, the loaded target has 4"
        ),
        "{text}"
    );
    assert!(
        text.contains("FAIL  its FLOPs, where it counts them, grow with the layers and the head: 1 layer"),
        "{text}"
    );
    assert!(
        text.contains(
            "FAIL  KV-cache extend / truncate equals recomputation: target plugin `synthetic`: cache_extend: the synthetic target has no KV cache"
        ),
        "{text}"
    );
    let drafter = build_plugin("tests/plugins/faulty_drafter", "faulty_drafter", &[], "faulty_drafter");
    let drafter = drafter.to_str().unwrap();
    let (code, text) = check(&[], &[drafter, "--section", "dead_parameter = true"]);
    assert_eq!(code, Some(1), "{text}");
    // Its description, written by hand, leaves out a field it parses.
    assert!(
        text.contains("FAIL  its check accepts the section given, every field of it described: its description has no such field: unknown field `dead_parameter`"),
        "{text}"
    );
    assert!(
        text.contains("pass  output shape")
            && text.contains("FAIL  gradients reach every trainable parameter: no gradient for unused.weight"),
        "{text}"
    );
    // A panic in `parameters` fails the clause that called it.
    let (code, text) = check(&[], &[drafter, "--section", "panic_in = \"parameters\""]);
    assert_eq!(code, Some(1), "{text}");
    assert!(
        text.contains(
            "FAIL  gradients reach every trainable parameter: drafter plugin `faulty_drafter`: parameters: panicked: deliberate panic in parameters"
        ),
        "{text}"
    );
    let data = build_plugin("tests/plugins/faulty_data", "faulty_data", &[], "faulty_data");
    let (code, text) = check(&[], &[data.to_str().unwrap(), "--section", "mask_prompt = true\nphantom_input = true"]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.contains("pass  describes its section"), "{text}");
    assert!(
        text.contains("FAIL  its check refuses an unknown field, naming it: `no_such_field_zz = 1` was accepted"),
        "{text}"
    );
    assert!(
        text.contains("FAIL  the files its check names are there: field `phantom_input`: /nonexistent/phantom.ids: no such file or folder"),
        "{text}"
    );
    assert!(text.contains("pass  seeking to a saved position gives the same batches"), "{text}");
    assert!(
        text.contains(
            "FAIL  the loss mask is on response tokens only: sequence 0: its first token is in the loss mask"
        ),
        "{text}"
    );
}

/// Pre-tokenized `PROMPT | RESPONSE` lines for the data template, in SmolLM2's vocabulary.
fn ids_file(dir: &Path) -> PathBuf {
    let ids = dir.join("train.ids");
    let lines: Vec<String> =
        (0..8).map(|i| format!("1 {} {} 2 | {} {} {} 2", 100 + i, 200 + i, 300 + i, 400 + i, 500 + i)).collect();
    std::fs::write(&ids, lines.join("\n")).unwrap();
    ids
}

/// The `next:` line `plugins new` printed, run by the shell as printed, without LIBTORCH or
/// LD_LIBRARY_PATH in its environment (the scaffold's `.cargo/config.toml` names the libtorch and
/// the host's target folder, so only the new crate compiles): it builds the library and checks
/// it, every clause passing. The library it built, copied where no running host maps it.
fn run_printed_line(out: &Output, name: &str) -> PathBuf {
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let line =
        text.lines().find_map(|l| l.strip_prefix("next: ")).unwrap_or_else(|| panic!("no next: line in\n{text}"));
    let so = root().join(format!("target/release/lib{name}.so"));
    assert!(line.contains(&format!("plugins check {}", so.display())), "{line}");
    let _one_at_a_time = common::BUILDS.lock().unwrap_or_else(|e| e.into_inner());
    let run = Command::new("sh")
        .args(["-c", line])
        .env_remove("LIBTORCH")
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&run.stdout).to_string() + &String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success() && said.contains("clauses pass"), "{line}:\n{said}");
    let dest = root().join(format!("target/test-plugins/{name}.so"));
    std::fs::create_dir_all(dest.parent().unwrap()).unwrap();
    let tmp = dest.with_extension(format!("so.{}", std::process::id()));
    std::fs::copy(&so, &tmp).unwrap();
    std::fs::rename(&tmp, &dest).unwrap();
    dest
}

/// `plugins new` -> `cargo build --release` -> `plugins check` -> `plugins doc`, `config explain`
/// and preflight's errors at the config's line -> `train --plugin`, for the templates of all four
/// kinds (built into the workspace's target folder, so only the new crate
/// compiles; a few seconds each; the optimizer's by the printed line), trained 2 steps.
#[test]
fn a_scaffolded_plugin_builds_passes_its_check_and_trains() {
    common::require_model();
    let dir = tempfile::tempdir().unwrap();
    let ids = ids_file(dir.path());
    let data_section = format!("path = {:?}\nbatch_size = 2", ids.display().to_string());
    let kinds = [
        ("optimizer", "scaffold_opt", "lr = 0.05".to_string()),
        ("data", "scaffold_data", data_section),
        ("drafter", "scaffold_drafter", "mask_token_id = 16\nintermediate_size = 64".to_string()),
        ("target", "scaffold_target", "seed = 1".to_string()),
    ];
    // Per kind: a field the reference shows, a bad value of a field and what its error says, a
    // misspelt field and the one meant.
    let probes = [
        ("| `lr` | float | required | > 0 |", "lr = -1.0", "field `lr`: must be > 0", "lrr", "lr"),
        (
            "| `batch_size` | integer | 2 | >= 1 |",
            "batch_size = 0",
            "field `batch_size`: must be >= 1",
            "batch_sizee",
            "batch_size",
        ),
        (
            "| `block_size` | integer | 4 | >= 2 |",
            "block_size = 1",
            "field `block_size`: must be >= 2",
            "block_sizee",
            "block_size",
        ),
        (
            "| `num_hidden_layers` | integer | 4 | >= 1 |",
            "num_hidden_layers = 0",
            "field `num_hidden_layers`: must be >= 1",
            "seedd",
            "seed",
        ),
    ];
    let head = HEAD.replace("steps = 20", "steps = 2");
    for ((kind, name, section), (row, bad, why, typo, meant)) in kinds.into_iter().zip(probes) {
        let crate_dir = dir.path().join(name);
        let out = Command::new(host())
            .args(["plugins", "new", name, "--kind", kind, "--out"])
            .arg(&crate_dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let so = match kind {
            // The optimizer's by the line `plugins new` prints, run as printed.
            "optimizer" => run_printed_line(&out, name),
            _ => build_plugin(crate_dir.to_str().unwrap(), name, &[], name),
        };
        let (code, text) = check(&[], &[so.to_str().unwrap(), "--section", &section]);
        assert_eq!(code, Some(0), "{kind}:\n{text}");
        // Its reference, from the library: `plugins doc` and `config explain`.
        let doc = common::host(&["plugins", "doc", so.to_str().unwrap()], &[]);
        let doc = String::from_utf8_lossy(&doc.stdout).to_string();
        assert!(doc.starts_with(&format!("# {kind} plugin `{name}`")) && doc.contains(row), "{kind}: {doc}");
        let explain = common::host(&["--plugin", so.to_str().unwrap(), "config", "explain", kind], &[]);
        let explain = String::from_utf8_lossy(&explain.stdout).to_string();
        assert!(explain.contains(&format!("plugin = \"{name}\"")) && explain.contains(row), "{kind}: {explain}");
        let with = |section: &str| {
            let section = format!("plugin = \"{name}\"\n{section}");
            match kind {
                "optimizer" => common::tiny_config(&head, &section),
                _ => with_section(&common::tiny_config(&head, "plugin = \"adamw\"\nlr = 3e-3"), kind, &section),
            }
        };
        // Preflight: its check's error and an unknown field, each at its line of the file.
        for (extra, want) in [
            (bad.to_string(), why.to_string()),
            (format!("{typo} = 1"), format!("unknown field `{typo}`, did you mean `{meant}`?")),
        ] {
            // The value replaces the section's own where it has one.
            let key = extra.split(" = ").next().unwrap();
            let kept: Vec<&str> = section.lines().filter(|l| !l.starts_with(&format!("{key} ="))).collect();
            let config = with(&format!("{}\n{extra}", kept.join("\n")));
            let line = config.lines().position(|l| l == extra).unwrap() + 1;
            let (out, _exp) = common::train(&[&so], &config);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{kind}: {extra} was accepted");
            assert!(
                err.contains(&format!("run.toml:{line}: [{kind}] plugin `{name}`: {want}")),
                "{kind}: {extra}: {err}"
            );
        }
        let config = with(&section);
        let (out, exp) = common::train(&[&so], &config);
        assert!(out.status.success(), "{kind}: {}", String::from_utf8_lossy(&out.stderr));
        let manifest = std::fs::read_to_string(exp.path().join("exp/manifest.json")).unwrap();
        assert!(
            manifest.contains(&format!("\"name\": \"{name}\"")) || manifest.contains(&format!("\"name\":\"{name}\"")),
            "{manifest}"
        );
    }
}

/// The four built-ins as shared libraries (`cargo build --workspace` leaves them in
/// target/release), each loaded by `--plugin` path in place of the linked one: a run gives the
/// same losses, metrics and checkpoints, byte for byte, as the same run with the built-ins linked
/// into the host. (Both runs share the cache of self-distilled replies, so the target generates
/// them in the first run only.)
#[test]
fn the_built_ins_as_shared_libraries_train_bit_for_bit_like_the_linked_ones() {
    let libs: Vec<PathBuf> = ["libtarget_hf.so", "libdrafter_dflash.so", "liboptim_adamw.so", "libdata_chat.so"]
        .iter()
        .map(|l| root().join("target/release").join(l))
        .collect();
    for l in &libs {
        assert!(l.exists(), "{} missing: `cargo build --release --workspace` builds it", l.display());
    }
    let config = common::tiny_config(&HEAD.replace("steps = 20", "steps = 8"), "plugin = \"adamw\"\nlr = 3e-3");
    let (loaded, so_dir) = common::train(&libs.iter().map(PathBuf::as_path).collect::<Vec<_>>(), &config);
    let err = String::from_utf8_lossy(&loaded.stderr);
    assert!(loaded.status.success(), "{err}");
    for (kind, name) in [("target", "hf"), ("drafter", "dflash"), ("optimizer", "adamw"), ("data", "chat")] {
        assert!(
            err.contains(&format!("{kind} plugin `{name}` from")) && err.contains("replaces the built-in"),
            "{err}"
        );
    }
    let (linked, linked_dir) = common::train(&[], &config);
    assert!(linked.status.success(), "{}", String::from_utf8_lossy(&linked.stderr));
    let (so_exp, linked_exp) = (so_dir.path().join("exp"), linked_dir.path().join("exp"));

    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(so_exp.join("manifest.json")).unwrap()).unwrap();
    let origins: Vec<&str> =
        manifest["plugins"].as_array().unwrap().iter().map(|p| p["origin"].as_str().unwrap()).collect();
    for l in &libs {
        assert!(origins.contains(&l.display().to_string().as_str()), "{origins:?}");
    }

    let keys =
        ["step", "epoch", "tokens", "draft_tokens", "loss", "acc", "tau_hat", "lr", "grad_norm", "skipped_steps"];
    let (so_metrics, linked_metrics) = (common::metrics(&so_exp, &keys), common::metrics(&linked_exp, &keys));
    assert_eq!(so_metrics.len(), 3, "metrics at steps 1, 5 and 8");
    assert_eq!(so_metrics, linked_metrics);

    let checkpoints = |exp: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(exp.join("checkpoints"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with("step-"))
            .collect();
        names.sort();
        names
    };
    let names = checkpoints(&so_exp);
    assert!(!names.is_empty());
    assert_eq!(names, checkpoints(&linked_exp));
    for step in &names {
        let file = |exp: &Path, f: &str| std::fs::read(exp.join("checkpoints").join(step).join(f)).unwrap();
        for f in ["model.safetensors", "optimizer.safetensors", "config.json"] {
            assert!(file(&so_exp, f) == file(&linked_exp, f), "{step}/{f} differs");
        }
        // The trainer's state, but for the wall times it records.
        let state = |exp: &Path| {
            let mut v: serde_json::Value = serde_json::from_slice(&file(exp, "trainer_state.json")).unwrap();
            for key in ["elapsed_s", "wall_s"] {
                v.as_object_mut().unwrap().remove(key).unwrap_or_else(|| panic!("{key} in trainer_state.json"));
            }
            v
        };
        assert_eq!(state(&so_exp), state(&linked_exp), "{step}/trainer_state.json");
    }
}
