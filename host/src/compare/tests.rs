use super::format::{fmt_count, fmt_stat, fmt_tokens_short, DASH};
use super::*;
use std::fs;

/// An A/B folder stands for its runs; every eval*.json is read; lr and gradient norm are read
/// and plotted, eval tau too when evals name their checkpoints; final values come per run.
#[test]
fn ab_folders_expand_evals_are_all_read_and_final_values_are_per_run() {
    let root = tempfile::tempdir().unwrap();
    let ab = root.path().join("ab");
    let short = fake_run(&ab, "a-s0", "x", Some("a"), &rows(1.0, 2000), true);
    let long = fake_run(&ab, "b-s0", "x", Some("b"), &rows(0.5, 20000), true);
    fs::create_dir_all(ab.join("report")).unwrap();
    fs::write(long.join("eval.json"), r#"{"tau": 1.8, "tau_pooled": 1.9, "cycles": 40, "prompts": 4, "source": "holdout", "evaluated": {"checkpoint_step": 200}}"#).unwrap();
    fs::write(long.join("eval-step-100.json"), r#"{"tau": 1.5, "tau_pooled": 1.6, "cycles": 50, "prompts": 4, "source": "holdout", "evaluated": {"checkpoint_step": 100}}"#).unwrap();
    fs::write(
        long.join("eval-humaneval-drafter-0123456789ab.json"),
        r#"{"tau": 2.5, "source": "humaneval", "evaluated": {"drafter": "/z"}}"#,
    )
    .unwrap();
    assert_eq!(expand_dirs(std::slice::from_ref(&ab)), vec![short.clone(), long.clone()]);
    let report = run(std::slice::from_ref(&ab), None, None).unwrap();
    assert_eq!(report, ab.join("report/report.md"));
    let md = fs::read_to_string(&report).unwrap();
    let runs = load_runs(&expand_dirs(std::slice::from_ref(&ab)), None);
    assert_eq!(
        runs[1].evals.iter().map(|e| e.file.as_str()).collect::<Vec<_>>(),
        ["eval.json", "eval-humaneval-drafter-0123456789ab.json", "eval-step-100.json"]
    );
    assert!(runs[1].records.iter().all(|r| r.lr == 1e-4 && r.grad_norm == 1.0));
    // The long run's own end (loss 10*0.5/20 = 0.25) next to the comparison at the short run's end.
    assert!(md.contains("## Final values") && md.contains("| b-s0 |") && md.contains("0.2500"), "{md}");
    assert!(md.contains("## Evaluations") && md.contains("eval-step-100.json") && md.contains("/z"), "{md}");
    for stem in ["lr_vs_tokens", "grad_norm_vs_tokens", "eval_tau_vs_tokens"] {
        assert!(ab.join(format!("report/{stem}.png")).exists(), "{stem}");
    }
    // Run again: the same folder, no second one.
    run(std::slice::from_ref(&ab), None, None).unwrap();
    let folders = fs::read_dir(&ab).unwrap().count();
    assert_eq!(folders, 3, "a-s0, b-s0, report");
}

/// A fake experiment: config (name), optional manifest arm, metrics from (tokens, loss, tau,
/// acc) rows, summary when `finished`.
fn fake_run(
    root: &Path,
    dir: &str,
    name: &str,
    arm: Option<&str>,
    rows: &[(u64, f64, f64, [f64; 3])],
    finished: bool,
) -> PathBuf {
    let d = root.join(dir);
    fs::create_dir_all(&d).unwrap();
    fs::write(d.join("config.toml"), format!("name = \"{name}\"\nseed = 0\n\n[optimizer]\nlr = 0.0006\n")).unwrap();
    let manifest = match arm {
        Some(a) => serde_json::json!({"seed": 0, "arm": a}),
        None => serde_json::json!({"seed": 0}),
    };
    fs::write(d.join("manifest.json"), manifest.to_string()).unwrap();
    let mut text = String::new();
    for (i, &(tokens, loss, tau, acc)) in rows.iter().enumerate() {
        let rec = serde_json::json!({
            "step": (i + 1) * 10, "epoch": 0, "tokens": tokens, "draft_tokens": tokens * 2, "loss": loss,
            "acc": acc, "tau_hat": tau, "lr": 1e-4, "grad_norm": 1.0, "tok_per_s": 100.0,
            "target_s": 0.1, "drafter_s": 0.2, "optim_s": 0.01, "elapsed_s": tokens as f64 / 100.0,
        });
        text += &rec.to_string();
        text.push('\n');
    }
    fs::write(d.join("metrics.jsonl"), text).unwrap();
    if finished {
        let wall = rows.last().map_or(0.0, |r| r.0 as f64 / 100.0);
        fs::write(
            d.join("summary.json"),
            serde_json::json!({"wall_s": wall, "tokens": rows.last().map(|r| r.0)}).to_string(),
        )
        .unwrap();
    }
    d
}

fn rows(scale: f64, last_tokens: u64) -> Vec<(u64, f64, f64, [f64; 3])> {
    (1..=last_tokens / 1000)
        .map(|k| {
            let t = k * 1000;
            (t, scale * 10.0 / k as f64, 1.0 + 0.1 * k as f64, [0.5 * scale, 0.25 * scale, 0.125 * scale])
        })
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-9 * (1.0 + a.abs().max(b.abs()))
}

#[test]
fn interpolates_linearly_at_equal_tokens() {
    let recs: Vec<Record> = [(1000.0, 10.0, 1.0, 10.0), (3000.0, 6.0, 2.0, 20.0), (5000.0, 8.0, 1.5, 40.0)]
        .iter()
        .enumerate()
        .map(|(i, &(tokens, loss, tau_hat, elapsed_s))| Record {
            step: i as u64,
            tokens,
            loss,
            acc: vec![0.2 * (i + 1) as f64, 0.1],
            tau_hat,
            elapsed_s,
            lr: 1e-3,
            grad_norm: 1.0,
        })
        .collect();
    let a = at_tokens(&recs, 2000.0).unwrap();
    assert!(close(a.loss, 8.0), "loss {}", a.loss);
    assert!(close(a.tau_hat, 1.5), "tau {}", a.tau_hat);
    assert!(close(a.acc[0], 0.3) && close(a.acc[1], 0.1), "acc {:?}", a.acc);
    assert!(close(a.elapsed_s, 15.0) && close(a.tok_per_s, 2000.0 / 15.0));
    assert!(close(a.best_loss, 8.0), "best loss over records ≤ T and T itself: {}", a.best_loss);
    // At 4000: loss 7 interpolated, best loss 6 (record at 3000); best tau 2.
    let b = at_tokens(&recs, 4000.0).unwrap();
    assert!(close(b.loss, 7.0) && close(b.best_loss, 6.0) && close(b.best_tau_hat, 2.0), "{b:?}");
    // Exact on a record; outside the logged span: None.
    assert!(close(at_tokens(&recs, 5000.0).unwrap().loss, 8.0));
    assert!(at_tokens(&recs, 5001.0).is_none() && at_tokens(&recs, 999.0).is_none());
}

#[test]
fn mean_and_sample_std() {
    let s = stat([1.0, 2.0, 3.0, 4.0]).unwrap();
    assert!(close(s.mean, 2.5));
    assert!(close(s.std.unwrap(), (5.0f64 / 3.0).sqrt()), "{s:?}");
    assert_eq!(stat([7.0]).unwrap().std, None);
    assert!(stat(std::iter::empty()).is_none());
    assert_eq!(fmt_stat(stat([1.0, 3.0]), 2, 2), "2.00 ± 1.41");
    assert_eq!(fmt_stat(stat([1.0]), 2, 3), "1.00 (n=1)");
    assert_eq!(fmt_count(1234567.0), "1,234,567");
    assert_eq!(fmt_tokens_short(12_500.0), "12.5k");
}

/// A run and its fork to another optimizer share a name: grouped apart, the fork's group named by
/// what differs (the plugin first); repeats that differ only in their seed stay one group.
#[test]
fn runs_of_one_name_under_different_configs_are_grouped_apart() {
    let root = tempfile::tempdir().unwrap();
    let parent = fake_run(root.path(), "fork-parent", "fork", None, &rows(1.0, 5000), true);
    let repeat = fake_run(root.path(), "fork-s1", "fork", None, &rows(1.1, 5000), true);
    fs::write(repeat.join("config.toml"), "name = \"fork\"\nseed = 1\n\n[optimizer]\nlr = 0.0006\n").unwrap();
    let child = fake_run(root.path(), "fork-muon", "fork", None, &rows(0.8, 5000), true);
    fs::write(
        child.join("config.toml"),
        "name = \"fork\"\nseed = 0\n\n[optimizer]\nplugin = \"muon\"\nlr = 0.0006\nmomentum = 0.9\n",
    )
    .unwrap();
    let runs = load_runs(&[parent, repeat, child], None);
    let groups: Vec<&str> = runs.iter().map(|r| r.group.as_str()).collect();
    assert_eq!(groups, ["fork", "fork", "fork (optimizer.plugin=\"muon\", optimizer.momentum=0.9)"]);
    let cmp = compare(&runs);
    assert_eq!(cmp.groups.iter().map(|g| g.members.clone()).collect::<Vec<_>>(), [vec![0, 1], vec![2]]);
}

#[test]
fn groups_by_arm_then_name_then_config_key() {
    let root = tempfile::tempdir().unwrap();
    let a1 = fake_run(root.path(), "a1", "base", Some("A"), &rows(1.0, 5000), true);
    let a2 = fake_run(root.path(), "a2", "base", Some("A"), &rows(1.2, 6000), true);
    let b1 = fake_run(root.path(), "b1", "muon", None, &rows(0.8, 4000), true);
    let dirs = vec![a1.clone(), a2.clone(), b1.clone()];
    let runs = load_runs(&dirs, None);
    assert_eq!(runs.iter().map(|r| r.group.as_str()).collect::<Vec<_>>(), ["A", "A", "muon"]);
    let cmp = compare(&runs);
    assert_eq!(cmp.tokens, Some(4000.0), "smallest final count among complete runs");
    assert!(cmp.from_complete);
    assert_eq!(cmp.groups.len(), 2);
    let a = &cmp.groups[0];
    assert_eq!((a.name.as_str(), a.members.as_slice()), ("A", &[0usize, 1][..]));
    // Loss at 4000 tokens: 10/4 = 2.5 and 12/4 = 3.0 -> mean 2.75, std sqrt(0.125).
    let loss = a.loss.unwrap();
    assert!(close(loss.mean, 2.75) && close(loss.std.unwrap(), 0.125f64.sqrt()), "{loss:?}");
    let acc1 = a.acc[0].unwrap();
    assert!(close(acc1.mean, 0.55), "{acc1:?}");
    assert!(close(a.final_tokens.unwrap().mean, 5500.0));
    assert_eq!(cmp.groups[1].members, vec![2]);

    let by_lr = load_runs(&dirs, Some("optimizer.lr"));
    assert!(by_lr.iter().all(|r| r.group == "optimizer.lr=0.0006"), "{:?}", by_lr[0].group);
    let by_missing = load_runs(&[a1], Some("train.nope"));
    assert_eq!(by_missing[0].group, "train.nope=?");
    assert!(by_missing[0].notes.iter().any(|n| n.contains("train.nope")));
}

#[test]
fn half_written_and_foreign_dirs_are_reported_not_fatal() {
    let root = tempfile::tempdir().unwrap();
    let good = fake_run(root.path(), "good", "x", None, &rows(1.0, 3000), true);
    // Truncated last line, no summary: unfinished, records before the cut kept.
    let cut = fake_run(root.path(), "cut", "x", None, &rows(1.0, 5000), false);
    let mut text = fs::read_to_string(cut.join("metrics.jsonl")).unwrap();
    text += "{\"step\": 60, \"tokens\": 60";
    fs::write(cut.join("metrics.jsonl"), text).unwrap();
    let empty = fake_run(root.path(), "empty", "x", None, &[], false);
    let nometrics = fake_run(root.path(), "nometrics", "x", None, &[], false);
    fs::remove_file(nometrics.join("metrics.jsonl")).unwrap();
    let foreign = root.path().join("photos");
    fs::create_dir_all(&foreign).unwrap();
    fs::write(foreign.join("cat.jpg"), b"meow").unwrap();
    let missing = root.path().join("nope");
    let dirs = vec![good, cut, empty, nometrics, foreign, missing];
    let runs = load_runs(&dirs, None);
    let status: Vec<Status> = runs.iter().map(|r| r.status).collect();
    use Status::*;
    assert_eq!(status, [Complete, Unfinished, EmptyMetrics, NoMetrics, NotExperiment, NotExperiment]);
    assert_eq!(runs[1].records.len(), 5);
    assert!(runs[1].notes.iter().any(|n| n.contains("truncated last line")), "{:?}", runs[1].notes);
    assert!(runs[1].notes.iter().any(|n| n.contains("no summary.json")));

    // The unfinished run reaches T = 3000 and shows values there, outside group statistics.
    let cmp = compare(&runs);
    assert_eq!(cmp.tokens, Some(3000.0));
    assert!(cmp.at[1].is_some() && !cmp.counted[1]);
    assert_eq!(cmp.groups[0].members, vec![0]);

    let out = root.path().join("report");
    fs::create_dir_all(&out).unwrap();
    let md = render_markdown(&runs, &cmp, &Sweeps::default(), &[], &[]);
    let term = render_terminal(&runs, &cmp, &Sweeps::default());
    for text in [&md, &term] {
        for want in
            ["truncated last line", "unfinished", "empty metrics", "no metrics", "not an experiment", "does not exist"]
        {
            assert!(text.contains(want), "missing `{want}` in:\n{text}");
        }
    }
}

#[test]
fn no_finished_run_gives_a_provisional_comparison() {
    let root = tempfile::tempdir().unwrap();
    let a = fake_run(root.path(), "a", "x", None, &rows(1.0, 3000), false);
    let b = fake_run(root.path(), "b", "x", None, &rows(1.0, 5000), false);
    let runs = load_runs(&[a, b], None);
    let cmp = compare(&runs);
    assert_eq!((cmp.tokens, cmp.from_complete), (Some(3000.0), false));
    assert_eq!(cmp.groups[0].members, vec![0, 1]);
    assert!(render_markdown(&runs, &cmp, &Sweeps::default(), &[], &[]).contains("provisional"));
}

#[test]
fn report_with_tables_and_png_svg_plots() {
    let root = tempfile::tempdir().unwrap();
    let mut dirs = Vec::new();
    for (i, scale) in [1.0, 1.1, 0.9].into_iter().enumerate() {
        dirs.push(fake_run(root.path(), &format!("base-s{i}"), "base", Some("adamw"), &rows(scale, 8000), true));
        dirs.push(fake_run(root.path(), &format!("muon-s{i}"), "muon", Some("muon"), &rows(scale * 0.7, 9000), true));
    }
    fs::write(dirs[0].join("eval.json"), r#"{"tau": 3.21}"#).unwrap();
    dirs.push(fake_run(root.path(), "live", "muon", Some("muon"), &rows(0.7, 4000), false));
    let out = root.path().join("cmp");
    let report = run(&dirs, Some(&out), None).unwrap();
    assert_eq!(report, out.join("report.md"));
    let md = fs::read_to_string(&report).unwrap();
    assert!(md.contains("| group | runs | loss @T |"), "{md}");
    assert!(md.contains("| adamw | 3 |"), "{md}");
    assert!(md.contains("| muon | 3 of 4 |"), "{md}");
    assert!(md.contains("T = 8,000 target tokens"), "{md}");
    assert!(md.contains(" ± "));
    assert!(md.contains("3.210") && md.contains(DASH), "eval tau column");
    assert!(md.contains("![Loss vs tokens](loss_vs_tokens.png)"));
    for stem in ["loss_vs_tokens", "tau_hat_vs_tokens", "acc_at_tokens"] {
        let png = out.join(format!("{stem}.png"));
        let img = image::open(&png).unwrap_or_else(|e| panic!("{}: {e}", png.display())).to_rgb8();
        assert_eq!(img.dimensions(), SIZE);
        // Non-trivial: many distinct colours (lines, text), not a blank canvas.
        let mut colors: Vec<[u8; 3]> = img.pixels().map(|p| p.0).collect();
        colors.sort_unstable();
        colors.dedup();
        assert!(colors.len() > 20, "{stem}.png has {} colours", colors.len());
        let svg = fs::read_to_string(out.join(format!("{stem}.svg"))).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("<polyline") && svg.contains("<text"), "{stem}.svg");
        assert!(svg.len() > 5_000, "{stem}.svg is {} bytes", svg.len());
    }
}

/// `compare::run` in a thread: a hang fails the test after `secs` instead of hanging the suite.
fn run_within(dirs: Vec<PathBuf>, out: PathBuf, secs: u64) -> Result<PathBuf> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(run(&dirs, Some(&out), None));
    });
    rx.recv_timeout(std::time::Duration::from_secs(secs)).expect("compare hung")
}

#[test]
fn absurd_values_are_treated_as_missing_and_plots_finish() {
    let root = tempfile::tempdir().unwrap();
    let a = fake_run(root.path(), "a", "x", None, &rows(1.0, 3000), true);
    let b = fake_run(root.path(), "b", "y", None, &rows(2.0, 3000), true);
    // One value of 1.7e308 (plotters' key-point search looped on the axis it made), one
    // infinite, one token count that is no count.
    let metrics = b.join("metrics.jsonl");
    let text = fs::read_to_string(&metrics).unwrap();
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    lines[1] = lines[1].replacen("\"loss\":", "\"loss\":1.7e308,\"x\":", 1);
    lines[2] = lines[2].replacen("\"tau_hat\":", "\"tau_hat\":1e999,\"y\":", 1);
    lines.push(lines[0].replacen("\"tokens\":", "\"tokens\":1.7e308,\"z\":", 1));
    fs::write(&metrics, lines.join("\n") + "\n").unwrap();
    let run_b = load_run(&b, None);
    assert!(run_b.records[1].loss.is_nan() && run_b.records[0].loss.is_finite(), "{:?}", run_b.records[1]);
    assert!(run_b.notes.iter().any(|n| n.contains("beyond ±1e15")), "{:?}", run_b.notes);
    assert!(run_b.notes.iter().any(|n| n.contains("is not a token count")), "{:?}", run_b.notes);
    let report = run_within(vec![a, b], root.path().join("cmp"), 120).unwrap();
    assert!(report.exists());
    assert!(root.path().join("cmp/loss_vs_tokens.svg").exists());
}

#[test]
fn a_fifo_or_device_as_a_run_file_is_a_note_not_a_hang() {
    let root = tempfile::tempdir().unwrap();
    let fifo_run = fake_run(root.path(), "fifo", "x", None, &rows(1.0, 3000), true);
    let zero_run = fake_run(root.path(), "zero", "x", None, &rows(1.0, 3000), true);
    for name in ["metrics.jsonl", "summary.json", "manifest.json"] {
        fs::remove_file(fifo_run.join(name)).unwrap();
        let c = std::ffi::CString::new(fifo_run.join(name).as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        fs::remove_file(zero_run.join(name)).unwrap();
        std::os::unix::fs::symlink("/dev/zero", zero_run.join(name)).unwrap();
    }
    run_within(vec![fifo_run.clone(), zero_run.clone()], root.path().join("cmp"), 60).unwrap();
    for dir in [fifo_run, zero_run] {
        let r = load_run(&dir, None);
        assert_eq!(r.status, Status::NoMetrics, "{}", dir.display());
        assert!(r.notes.iter().any(|n| n.contains("not a regular file")), "{:?}", r.notes);
    }
}

#[test]
fn default_out_is_one_folder_beside_the_runs_or_in_the_ab() {
    let root = tempfile::tempdir().unwrap();
    let a = fake_run(root.path(), "exp1", "x", None, &rows(1.0, 3000), true);
    assert_eq!(default_out(std::slice::from_ref(&a)), root.path().join("compare"), "reused, not a fresh name");
    assert_eq!(default_out(&[root.path().to_path_buf()]), root.path().join("report"), "an A/B folder's report");
    assert_eq!(utc_timestamp(0.0, true), "1970-01-01 00:00:00");
    assert_eq!(utc_timestamp(951_782_400.0, false), "20000229-000000");
}

/// The validation scores on a run's last metrics line.
fn with_val(dir: &Path, loss: f64, tau_hat: f64) {
    let path = dir.join("metrics.jsonl");
    let mut lines: Vec<serde_json::Value> =
        fs::read_to_string(&path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let last = lines.last_mut().unwrap();
    last["val_loss"] = loss.into();
    last["val_tau_hat"] = tau_hat.into();
    last["val_acc"] = serde_json::json!([0.5, 0.25, 0.1]);
    fs::write(&path, lines.iter().map(|l| l.to_string() + "\n").collect::<String>()).unwrap();
}

#[test]
fn a_swept_arm_is_compared_at_its_chosen_value_and_its_sweep_shown_apart() {
    let root = tempfile::tempdir().unwrap();
    let ab = root.path().join("ab");
    for (dir, arm, scale, val) in [
        ("adamw-lr=0.001-s0", "adamw", 2.0, (3.0, 1.2)),
        ("adamw-lr=0.003-s0", "adamw", 1.0, (2.0, 1.6)),
        ("adamw-lr=0.003-s1", "adamw", 1.1, (2.1, 1.5)),
        ("muon-s0", "muon", 0.8, (1.8, 1.7)),
        ("muon-s1", "muon", 0.9, (1.9, 1.8)),
    ] {
        let d = fake_run(&ab, dir, "x", Some(arm), &rows(scale, 5000), true);
        with_val(&d, val.0, val.1);
    }
    fs::write(ab.join("muon-s0/eval.json"), r#"{"tau": 2.0, "source": "holdout"}"#).unwrap();
    fs::write(ab.join("muon-s1/eval.json"), r#"{"tau": 2.2, "source": "holdout"}"#).unwrap();
    fs::write(ab.join("muon-s0/eval-validation.json"), r#"{"tau": 1.9, "source": "validation"}"#).unwrap();
    let point = |label: &str, lr: f64, score: f64| SweepScore {
        label: label.into(),
        values: [("optimizer.lr".to_string(), serde_json::json!(lr))].into(),
        run: format!("adamw-{label}-s0"),
        score: Some(score),
    };
    let selection = Selection {
        select: "val_tau_hat".into(),
        higher_is_better: true,
        seed: 0,
        arms: vec![ArmSweep {
            arm: "adamw".into(),
            fields: vec!["optimizer.lr".into()],
            points: vec![point("lr=0.001", 0.001, 1.2), point("lr=0.003", 0.003, 1.6)],
            chosen: "lr=0.003".into(),
            chosen_runs: vec!["adamw-lr=0.003-s0".into(), "adamw-lr=0.003-s1".into()],
        }],
    };
    fs::write(ab.join(SELECTION_FILE), serde_json::to_string(&selection).unwrap()).unwrap();
    let md = fs::read_to_string(run(std::slice::from_ref(&ab), None, None).unwrap()).unwrap();
    // The sweep: both values, the score that chose, the chosen one marked, its plot.
    assert!(md.contains("## Sweeps") && md.contains("chosen: **lr=0.003**"), "{md}");
    assert!(md.contains("| lr=0.001 | adamw-lr=0.001-s0 | complete | 1.2000 | 3.0000 | 1.200 |"), "{md}");
    assert!(
        md.contains("| lr=0.003 | adamw-lr=0.003-s0 | complete | 1.6000 | 2.0000 | 1.600 |") && md.contains("| yes |"),
        "{md}"
    );
    assert!(ab.join("report/sweep_adamw.png").exists() && md.contains("(sweep_adamw.png)"));
    // The comparison: adamw is its two runs at lr=0.003, never the other value.
    assert!(md.contains("| adamw | 2 |") && md.contains("| muon | 2 |"), "{md}");
    // Held-out data: validation at each run's end, real tau on validation and test prompts.
    assert!(md.contains("| adamw | 2 | 2.0500 ± 0.0707 | 1.550 ± 0.071 | — | — |"), "{md}");
    assert!(md.contains("| muon | 2 | 1.8500 ± 0.0707 | 1.750 ± 0.071 | 1.900 (n=1) | 2.100 ± 0.141 |"), "{md}");
    // Equal wall time: every run ends at 50 s here.
    assert!(md.contains("W = 50.0 training seconds"), "{md}");
    assert!(ab.join("report/val_tau_hat_vs_tokens.png").exists());
}

/// A fork's curve is its parent's up to the fork step, then its own.
#[test]
fn a_forks_curve_begins_with_its_parents_up_to_the_fork() {
    let root = tempfile::tempdir().unwrap();
    // The parent: steps 10..=50 (tokens 1000..5000); the fork at step 30 logs steps 40 and 50.
    let parent = fake_run(root.path(), "parent", "p", None, &rows(1.0, 5000), false);
    let all = fake_run(root.path(), "fork", "f", Some("muon"), &rows(0.5, 5000), true);
    let own: String =
        fs::read_to_string(all.join("metrics.jsonl")).unwrap().lines().skip(3).map(|l| l.to_string() + "\n").collect();
    fs::write(all.join("metrics.jsonl"), own).unwrap();
    let manifest = serde_json::json!({"seed": 0, "arm": "muon", "parent": {"path": parent, "step": 30}});
    fs::write(all.join("manifest.json"), manifest.to_string()).unwrap();
    let run = load_run(&all, None);
    let steps: Vec<u64> = run.records.iter().map(|r| r.step).collect();
    assert_eq!(steps, [10, 20, 30, 40, 50]);
    // The parent's loss (scale 1) up to the fork, the fork's own (scale 0.5) after it.
    assert!(close(run.records[2].loss, 10.0 / 3.0) && close(run.records[3].loss, 0.5 * 10.0 / 4.0));
    assert!(run.notes.iter().any(|n| n.contains("steps up to 30 are its parent's")), "{:?}", run.notes);
}
