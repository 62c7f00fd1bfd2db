use super::*;

fn builtins() -> Registry {
    Registry::new(&[]).unwrap()
}

const BASE: &str = r#"
name = "base"
[train]
steps = 10
[target]
plugin = "hf"
path = "m.gguf"
[drafter]
plugin = "dflash"
block_size = 8
[optimizer]
plugin = "adamw"
lr = 1e-3
betas = [0.9, 0.95]
[data]
plugin = "chat"
path = "d.json"
"#;

const AB: &str = r#"
name = "opt"
base = "base.toml"
seeds = [0, 1]
[common]
train = { steps = 7 }
[arms.adamw]
optimizer = { lr = 2e-3 }
[arms.muon]
optimizer = { plugin = "muon", lr = 0.02 }
drafter = { block_size = 4 }
"#;

#[test]
fn arms_differ_only_in_what_they_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("base.toml"), BASE).unwrap();
    std::fs::write(dir.path().join("ab.toml"), AB).unwrap();
    let p = plan(&dir.path().join("ab.toml"), None, Path::new("experiments"), &builtins()).unwrap();
    let runs: Vec<&ArmRun> = p.all_runs().collect();
    let names: Vec<_> = runs.iter().map(|r| (r.arm.as_str(), r.seed, r.config.name.as_str())).collect();
    assert_eq!(
        names,
        [
            ("adamw", 0, "opt-adamw-s0"),
            ("adamw", 1, "opt-adamw-s1"),
            ("muon", 0, "opt-muon-s0"),
            ("muon", 1, "opt-muon-s1")
        ]
    );
    assert_eq!(runs[2].dir, Path::new("experiments/opt/muon-s0"));
    // Same-plugin change merges (betas kept); another plugin replaces the section.
    let adamw = runs[0].config.section("optimizer");
    assert_eq!((adamw.plugin.as_str(), adamw.config_toml.contains("betas")), ("adamw", true));
    assert!(adamw.config_toml.contains("lr = 0.002"));
    let muon = runs[2].config.section("optimizer");
    assert_eq!(muon.plugin, "muon");
    assert!(!muon.config_toml.contains("betas"), "{}", muon.config_toml);
    assert!(runs[2].config.section("drafter").config_toml.contains("block_size = 4"));
    assert!(runs[0].config.section("drafter").config_toml.contains("block_size = 8"));
    // Everything else is identical.
    assert_eq!((runs[0].config.train.steps, runs[2].config.train.steps), (7, 7));
    assert_eq!(runs[0].config.section("data").config_toml, runs[2].config.section("data").config_toml);
    assert_eq!(runs[1].config.seed, runs[3].config.seed);
    let more = plan(&dir.path().join("ab.toml"), Some(3), Path::new("x"), &builtins()).unwrap();
    assert_eq!(more.all_runs().count(), 6);
    // `ab --device`: every run moves, nothing else does.
    let before: Vec<String> = more.all_runs().map(|r| r.config.device.clone()).collect();
    assert!(before.iter().all(|d| d != "cuda:1"));
    let moved = more.on_device("cuda:1");
    assert!(moved.all_runs().all(|r| r.config.device == "cuda:1" && r.config.train.steps == 7));
}

#[test]
fn a_rerun_resumes_unfinished_arms_keeps_finished_ones_and_refuses_edited_ones() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("base.toml"), BASE).unwrap();
    std::fs::write(dir.path().join("ab.toml"), AB).unwrap();
    let p = plan(&dir.path().join("ab.toml"), None, &dir.path().join("experiments"), &builtins()).unwrap();
    let runs: Vec<&ArmRun> = p.all_runs().collect();
    let r = runs[0];
    assert_eq!(arm_state(r).unwrap(), ArmState::New);
    let exp =
        crate::experiment::Experiment::create(&r.dir, &toml::to_string(&r.config).unwrap(), &serde_json::json!({}))
            .unwrap();
    drop(exp);
    assert_eq!(arm_state(r).unwrap(), ArmState::Unfinished);
    std::fs::write(r.dir.join("summary.json"), "{}").unwrap();
    assert_eq!(arm_state(r).unwrap(), ArmState::Finished);
    std::fs::remove_file(r.dir.join("summary.json")).unwrap();
    // The A/B file was edited since the arm started: refused, naming the field; nothing deleted.
    std::fs::write(dir.path().join("ab.toml"), AB.replace("lr = 2e-3", "lr = 5e-3")).unwrap();
    let edited = plan(&dir.path().join("ab.toml"), None, &dir.path().join("experiments"), &builtins()).unwrap();
    let err = arm_state(edited.all_runs().next().unwrap()).unwrap_err().to_string();
    assert!(
        err.contains("arm `adamw` seed 0") && err.contains("`optimizer.lr` changed: 0.002 then, 0.005 now"),
        "{err}"
    );
    assert!(r.dir.join("config.toml").exists());
    std::fs::remove_dir_all(&runs[1].dir).ok();
    std::fs::create_dir_all(&runs[1].dir).unwrap();
    std::fs::write(runs[1].dir.join("stray"), "").unwrap();
    assert!(arm_state(runs[1]).unwrap_err().to_string().contains("not an experiment"));
}

#[test]
fn bad_ab_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("base.toml"), BASE).unwrap();
    std::fs::write(dir.path().join("ab.toml"), AB.replace("[arms.muon]", "[arms.muon]\nstepz = 3")).unwrap();
    let err = plan(&dir.path().join("ab.toml"), None, Path::new("e"), &builtins()).unwrap_err().to_string();
    assert!(err.contains("arm `muon`") && err.contains("stepz"), "{err}");
    std::fs::write(dir.path().join("one.toml"), "name = \"x\"\nbase = \"base.toml\"\n[arms.a]\n").unwrap();
    let err = plan(&dir.path().join("one.toml"), None, Path::new("e"), &builtins()).unwrap_err().to_string();
    assert!(err.contains("at least two arms"), "{err}");
}

#[test]
fn ab_and_arm_names_that_could_leave_experiments_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("base.toml"), BASE).unwrap();
    let ab = dir.path().join("ab.toml");
    for bad in ["../up", "a/b", ".hidden", ".."] {
        std::fs::write(&ab, AB.replace("name = \"opt\"", &format!("name = {:?}", bad))).unwrap();
        let err = plan(&ab, None, Path::new("e"), &builtins()).unwrap_err().to_string();
        assert!(err.contains("ab.toml") && err.contains("not a valid experiment name"), "{bad}: {err}");
        std::fs::write(&ab, AB.replace("[arms.muon]", &format!("[arms.{:?}]", bad))).unwrap();
        let err = plan(&ab, None, Path::new("e"), &builtins()).unwrap_err().to_string();
        assert!(err.contains(&format!("arm `{bad}`")) && err.contains("not a valid experiment name"), "{bad}: {err}");
    }
}

/// An A/B whose `adamw` arm sweeps its learning rate; validation on (split and eval_every).
const SWEEP: &str = r#"
name = "opt"
base = "base.toml"
seeds = [0, 1]
[common]
train = { steps = 7, eval_every = 5 }
data = { validation = 2, eval_holdout = 3 }
[arms.adamw]
sweep = { "optimizer.lr" = [1e-3, 3e-3, 1e-2] }
[arms.muon]
optimizer = { plugin = "muon", lr = 0.02 }
"#;

fn sweep_plan(ab: &str, root: &Path) -> Result<Plan> {
    std::fs::write(root.join("base.toml"), BASE)?;
    std::fs::write(root.join("ab.toml"), ab)?;
    // The data plugin's check (which says how many records it holds out) finds its dataset.
    std::fs::write(root.join("d.json"), "[]")?;
    plan(&root.join("ab.toml"), None, &root.join("experiments"), &builtins())
}

fn folder(r: &ArmRun) -> String {
    r.dir.file_name().unwrap().to_string_lossy().into_owned()
}

#[test]
fn a_sweep_runs_every_value_with_the_first_seed_then_every_seed_at_the_chosen_one() {
    let dir = tempfile::tempdir().unwrap();
    let p = sweep_plan(SWEEP, dir.path()).unwrap();
    assert_eq!(p.select, Some(Select::ValTauHat), "no [eval]: chosen by the validation split's tau-hat");
    assert_eq!(p.arms[0].fields, ["optimizer.lr"]);
    let first: Vec<String> = p.first_seed_runs().map(folder).collect();
    assert_eq!(first, ["adamw-lr=0.001-s0", "adamw-lr=0.003-s0", "adamw-lr=0.01-s0", "muon-s0"]);
    // Each value is set in its run's config, and nothing else differs from the base.
    let runs: Vec<&ArmRun> = p.first_seed_runs().collect();
    for (r, lr) in runs.iter().zip(["lr = 0.001", "lr = 0.003", "lr = 0.01"]) {
        let opt = r.config.section("optimizer");
        assert!(opt.config_toml.contains(lr) && opt.config_toml.contains("betas"), "{}", opt.config_toml);
        assert_eq!((r.config.train.steps, r.config.train.eval_every, r.seed), (7, 5, 0));
    }
    assert_eq!(runs[1].config.name, "opt-adamw-lr_0.003-s0");
    assert_eq!(runs[1].point.as_deref(), Some("lr=0.003"));
    assert_eq!(runs[3].point, None);
    // Phase 2: every seed at the chosen value (and the unswept arm's every seed), seed by seed.
    let chosen = BTreeMap::from([("adamw".to_string(), "lr=0.003".to_string())]);
    let compared: Vec<String> = p.compared_runs(&chosen).into_iter().map(folder).collect();
    assert_eq!(compared, ["adamw-lr=0.003-s0", "muon-s0", "adamw-lr=0.003-s1", "muon-s1"]);
    assert_eq!(p.compared_runs(&chosen)[2].config.seed, 1);
    assert_eq!(p.all_runs().count(), 3 * 2 + 2, "every value x seed is planned (and checked)");
    // With [eval], real tau on the validation prompts chooses.
    let with_eval = sweep_plan(&SWEEP.replace("[arms.adamw]", "[eval]\nlimit = 4\n[arms.adamw]"), dir.path()).unwrap();
    assert_eq!(
        (with_eval.select, with_eval.eval.as_ref().map(|e| (e.limit, e.max_new_tokens))),
        (Some(Select::ValTau), Some((4, 64)))
    );
    // Without a sweep, nothing to choose and the folders are as they always were.
    let plain = sweep_plan(
        &SWEEP.replace("sweep = { \"optimizer.lr\" = [1e-3, 3e-3, 1e-2] }", "optimizer = { lr = 2e-3 }"),
        dir.path(),
    )
    .unwrap();
    assert_eq!(plain.select, None);
    assert_eq!(
        plain.compared_runs(&BTreeMap::new()).into_iter().map(folder).collect::<Vec<_>>(),
        ["adamw-s0", "muon-s0", "adamw-s1", "muon-s1"]
    );
}

#[test]
fn a_sweep_without_a_validation_measure_is_refused_before_any_run() {
    let dir = tempfile::tempdir().unwrap();
    for (edit, want) in [
        (("eval_every = 5", "eval_every = 0"), "lr=0.001: chosen by val_tau_hat, but `train.eval_every` is 0"),
        (
            ("name = \"opt\"", "name = \"opt\"\nselect = \"val_tau\""),
            "lr=0.001: chosen by val_tau (real tau on the validation prompts), but the A/B has no [eval] table",
        ),
        (("validation = 2", "validation = 0"), "[data] has `validation = 0`"),
        (
            ("eval_holdout = 3 }\n", "eval_holdout = 0 }\n[eval]\n"),
            "[eval] decodes the validation and the test prompts, but [data] has `validation = 2`, `eval_holdout = 0`",
        ),
        (("\"optimizer.lr\" = [1e-3, 3e-3, 1e-2]", "\"train.stepz\" = [1, 2]"), "arm `adamw`: unknown field `stepz`"),
        (("name = \"opt\"", "name = \"opt\"\nselect = \"test_tau\""), "unknown variant `test_tau`"),
    ] {
        let err = sweep_plan(&SWEEP.replace(edit.0, edit.1), dir.path()).unwrap_err().to_string();
        assert!(err.contains(want) && err.contains("ab.toml"), "{edit:?}: {err}");
    }
}

/// A finished run folder for the selection: metrics lines (training tau-hat, then validation
/// scores at the last step), and the two eval files.
fn scored_run(dir: &Path, train_tau_hat: f64, val: (f64, f64), val_tau: f64, test_tau: f64) {
    std::fs::create_dir_all(dir).unwrap();
    let lines = [
        serde_json::json!({"step": 5, "tokens": 50, "loss": 3.0, "tau_hat": 1.0, "val_loss": 1.0, "val_tau_hat": 9.0}),
        serde_json::json!({"step": 7, "tokens": 70, "loss": 2.0, "tau_hat": train_tau_hat, "val_loss": val.0, "val_tau_hat": val.1}),
    ];
    std::fs::write(dir.join("metrics.jsonl"), lines.map(|l| l.to_string() + "\n").concat()).unwrap();
    std::fs::write(
        dir.join(crate::eval::VALIDATION_FILE),
        serde_json::json!({"tau": val_tau, "source": "validation"}).to_string(),
    )
    .unwrap();
    std::fs::write(dir.join("eval.json"), serde_json::json!({"tau": test_tau, "source": "holdout"}).to_string())
        .unwrap();
}

#[test]
fn the_value_is_chosen_on_the_validation_split_never_on_the_test_prompts_or_training() {
    let dir = tempfile::tempdir().unwrap();
    let p = sweep_plan(&SWEEP.replace("[arms.adamw]", "[eval]\n[arms.adamw]"), dir.path()).unwrap();
    let at = |label: &str| p.dir.join(format!("adamw-{label}-s0"));
    // Test tau and training tau-hat would pick lr=0.001; validation loss lr=0.01; validation tau
    // and validation tau-hat (at the last step; the first line's 9.0 is history) lr=0.003.
    scored_run(&at("lr=0.001"), 3.0, (2.0, 1.4), 1.5, 2.5);
    scored_run(&at("lr=0.003"), 1.2, (1.9, 1.9), 1.9, 1.2);
    scored_run(&at("lr=0.01"), 1.1, (1.5, 1.6), 1.7, 1.3);
    let s = choose(&p).unwrap();
    assert_eq!((s.select.as_str(), s.higher_is_better, s.seed), ("val_tau", true, 0));
    let a = &s.arms[0];
    assert_eq!((a.arm.as_str(), a.chosen.as_str()), ("adamw", "lr=0.003"));
    assert_eq!(a.chosen_runs, ["adamw-lr=0.003-s0", "adamw-lr=0.003-s1"]);
    assert_eq!(a.points.iter().map(|x| x.score).collect::<Vec<_>>(), [Some(1.5), Some(1.9), Some(1.7)]);
    assert_eq!(a.points[0].values["optimizer.lr"], serde_json::json!(0.001));
    assert_eq!(s.arms.len(), 1, "the unswept arm has nothing to choose");
    let by = |select: &str| {
        let p =
            sweep_plan(&SWEEP.replace("name = \"opt\"", &format!("name = \"opt\"\nselect = \"{select}\"")), dir.path())
                .unwrap();
        choose(&p).unwrap().arms[0].chosen.clone()
    };
    assert_eq!(by("val_tau_hat"), "lr=0.003");
    assert_eq!(by("val_loss"), "lr=0.01", "lowest validation loss");
    // selection.json is what compare reads back.
    select::write(&p, &s).unwrap();
    let back: crate::compare::Selection =
        crate::experiment::read_json(&p.dir.join(crate::compare::SELECTION_FILE)).unwrap();
    assert_eq!(back, s);
    // A value with no score is never chosen; none at all is an error naming the runs.
    std::fs::remove_file(at("lr=0.003").join(crate::eval::VALIDATION_FILE)).unwrap();
    assert_eq!(choose(&p).unwrap().arms[0].chosen, "lr=0.01");
    for l in ["lr=0.001", "lr=0.01"] {
        std::fs::remove_file(at(l).join(crate::eval::VALIDATION_FILE)).unwrap();
    }
    let err = choose(&p).unwrap_err().to_string();
    assert!(
        err.contains("arm `adamw`: none of its swept values has a val_tau") && err.contains("adamw-lr=0.001-s0"),
        "{err}"
    );
}

#[test]
fn best_takes_the_first_of_equals_and_skips_the_unscored() {
    assert_eq!(select::best(&[Some(1.0), Some(2.0), Some(2.0)], true), Some(1));
    assert_eq!(select::best(&[None, Some(2.0), Some(1.0)], false), Some(2));
    assert_eq!(select::best(&[None, None], true), None);
}

#[test]
fn the_ab_files_in_configs_plan() {
    let configs = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&configs).unwrap().map(|e| e.unwrap().path()).collect();
    files.retain(|f| f.file_name().unwrap().to_string_lossy().starts_with("ab-"));
    assert!(files.len() >= 3, "{files:?}");
    // A fork A/B plans against its parent: the committed config it is trained from.
    let parents = [
        ("experiments/adamw-parent", "smollm2-chitchat-adamw.toml"),
        ("experiments/gdn-deep-adamw-4x", "gdn-deep-adamw-4x.toml"),
    ];
    let scratch = tempfile::tempdir().unwrap();
    for mut f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        if text.contains("[fork]") {
            let (exp, config) = parents
                .iter()
                .find(|(exp, _)| text.contains(&format!("exp = \"{exp}\"")))
                .unwrap_or_else(|| panic!("{}: its parent is not in this test's list", f.display()));
            let parent = scratch.path().join(Path::new(exp).file_name().unwrap());
            std::fs::create_dir_all(&parent).unwrap();
            std::fs::copy(configs.join(config), parent.join("config.toml")).unwrap();
            let copy = scratch.path().join(f.file_name().unwrap());
            std::fs::write(&copy, text.replace(exp, &parent.display().to_string())).unwrap();
            f = copy;
        }
        plan(&f, None, Path::new("experiments"), &builtins()).unwrap_or_else(|e| panic!("{}: {e:#}", f.display()));
    }
    let p = plan(&configs.join("ab-adamw-vs-muon-lr.toml"), None, Path::new("experiments"), &builtins()).unwrap();
    let first: Vec<String> = p.first_seed_runs().map(folder).collect();
    assert_eq!(
        first,
        [
            "adamw-lr=0.001-s0",
            "adamw-lr=0.003-s0",
            "adamw-lr=0.01-s0",
            "muon-adamw.lr=0.001-optimizer.lr=0.001-s0",
            "muon-adamw.lr=0.003-optimizer.lr=0.003-s0",
            "muon-adamw.lr=0.01-optimizer.lr=0.01-s0"
        ]
    );
    assert_eq!((p.select, p.eval.as_ref().map(|e| e.limit)), (Some(Select::ValTauHat), Some(16)));
    let muon = p.first_seed_runs().nth(4).unwrap().config.section("optimizer");
    assert!(muon.config_toml.contains("lr = 0.003") && muon.config_toml.contains("adjust_lr"), "{}", muon.config_toml);
}

#[test]
fn fork_arms_start_from_the_parents_config_and_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let parent = dir.path().join("parent");
    std::fs::create_dir(&parent).unwrap();
    std::fs::write(parent.join("config.toml"), BASE).unwrap();
    let ab = format!(
        r#"
name = "switch"
seeds = [3, 4]
[fork]
exp = "{}"
at = 5
[arms.adamw]
[arms.muon]
optimizer = {{ plugin = "muon", lr = 0.02 }}
fork = {{ optimizer_state = "fresh", schedule = "restart", rewarm = 2 }}
"#,
        parent.display()
    );
    std::fs::write(dir.path().join("ab.toml"), &ab).unwrap();
    let p = plan(&dir.path().join("ab.toml"), None, Path::new("experiments"), &builtins()).unwrap();
    let runs: Vec<&ArmRun> = p.all_runs().collect();
    assert_eq!(runs.len(), 4);
    for r in &runs {
        let f = r.fork.as_ref().expect("every arm forks");
        assert_eq!((f.parent.as_path(), f.at), (parent.as_path(), 5));
        assert_eq!(r.config.train.steps, 10, "the parent's schedule");
        assert_eq!(r.config.seed, r.seed, "the seed varies what follows the fork");
    }
    use crate::train::fork::{OptimizerStateChoice, ScheduleChoice};
    let adamw = runs[0].fork.as_ref().unwrap();
    assert_eq!(adamw.choices, ArmFork::default());
    assert!(runs[0].config.section("optimizer").config_toml.contains("betas"));
    let muon = runs[2].fork.as_ref().unwrap();
    assert_eq!(
        muon.choices,
        ArmFork {
            optimizer_state: Some(OptimizerStateChoice::Fresh),
            schedule: ScheduleChoice::Restart,
            rewarm: Some(2)
        }
    );
    let section = runs[2].config.section("optimizer");
    assert!(section.plugin == "muon" && !section.config_toml.contains("betas"), "{}", section.config_toml);

    // Refused: a fork step past the schedule, `base` beside [fork], an arm's `fork` without it.
    let past = ab.replace("at = 5", "at = 10");
    std::fs::write(dir.path().join("ab.toml"), &past).unwrap();
    let e = plan(&dir.path().join("ab.toml"), None, Path::new("experiments"), &builtins()).unwrap_err();
    assert!(format!("{e:#}").contains("[fork] at = 10: train.steps is 10"), "{e:#}");
    std::fs::write(dir.path().join("base.toml"), BASE).unwrap();
    let both = ab.replace("seeds = [3, 4]", "seeds = [3, 4]\nbase = \"base.toml\"");
    std::fs::write(dir.path().join("ab.toml"), &both).unwrap();
    let e = plan(&dir.path().join("ab.toml"), None, Path::new("experiments"), &builtins()).unwrap_err();
    assert!(format!("{e:#}").contains("`base` and [fork] exclude each other"), "{e:#}");
    let stray = AB.replace("[arms.muon]", "[arms.muon]\nfork = { rewarm = 2 }");
    std::fs::write(dir.path().join("ab.toml"), &stray).unwrap();
    let e = plan(&dir.path().join("ab.toml"), None, Path::new("experiments"), &builtins()).unwrap_err();
    assert!(format!("{e:#}").contains("arm `muon`: `fork` needs the A/B's [fork]"), "{e:#}");
}
