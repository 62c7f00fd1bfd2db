//! Outputs that never destroy data, and refusals before anything is written, through the binary
//! as a user runs it (docs/RELIABILITY.md): an output is never one of the command's inputs nor
//! written through a link planted in it (`compare`'s, `capture`'s); an experiment moved into `export --out` while the
//! export runs is kept; a checkpoints folder is known wherever it is; a fork or a run refused
//! for its data, its optimizer state or its chat template leaves no folder behind; forks
//! started at once with the default name each take their own.

mod common;

use common::cache;
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

fn host() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dflash-host"));
    cmd.env("DFLASH_CACHE", cache()).env_remove("RUST_BACKTRACE");
    cmd
}

fn ok(out: Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{err}");
    err
}

/// The last line of a failed command (its one error line).
fn refused(out: Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "not refused: {err}");
    err.lines().last().unwrap_or_default().to_string()
}

fn names(dir: &Path) -> Vec<String> {
    let mut n: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    n.sort();
    n
}

/// A folder with the tiny HF model, `chats.jsonl` (`n` records) and `run.toml` (`extra` lines
/// at the top: name, [train] fields come from `tiny_hf_config`).
fn project(dir: &Path, n: usize, data_extra: &str) -> PathBuf {
    common::write_tiny_hf_model(&dir.join("tiny"));
    std::fs::write(dir.join("chats.jsonl"), common::tiny_chats(n)).unwrap();
    let text = common::tiny_hf_config("name = \"out\"\nseed = 2", "path = \"tiny\"", "chats.jsonl")
        .replace("log_every = 1", "log_every = 1\ncheckpoint_every = 1\nkeep_checkpoints = 4\neval_every = 0")
        .replace("distill_max_new_tokens = 8", &format!("distill_max_new_tokens = 8\n{data_extra}"));
    let cfg = dir.join("run.toml");
    std::fs::write(&cfg, text).unwrap();
    cfg
}

/// A finished 4-step run (a checkpoint every step) of the tiny model, made once per test process.
fn parent() -> &'static PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("outputs-parent");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = project(&dir, 16, "");
        let exp = dir.join("runs/parent");
        ok(host().args(["train", "--config"]).arg(&cfg).arg("--exp-dir").arg(&exp).output().unwrap());
        exp
    })
}

/// Every file under `dir` with its bytes (links as their target's path), sorted.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_symlink() {
                out.push((p.clone(), std::fs::read_link(&p).unwrap().display().to_string().into_bytes()));
            } else if meta.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

/// `distill --out` onto the run's own data set (or a hard link to it, or its config file) once
/// replaced the data with the few records it wrote; `compare --out D` wrote its report and plots
/// through links in D into an experiment's files. Outputs are checked against the command's
/// inputs (by path and by device and inode) before any work, and written in their folder without
/// following links.
#[test]
fn an_output_is_never_an_input_nor_written_through_a_link() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let cfg = project(root, 8, "distill = \"last\"");
    std::fs::hard_link(root.join("chats.jsonl"), root.join("same-data.jsonl")).unwrap();
    let before = snapshot(root);
    for (out, why) in [
        (root.join("chats.jsonl"), "is field `data.path`"),
        (root.join("same-data.jsonl"), "is field `data.path`"),
        (cfg.clone(), "is the config file"),
        (root.join("tiny/config.json"), "field `target"),
        (root.join("tiny"), "field `target"),
    ] {
        let started = Instant::now();
        let line = refused(host().args(["distill", "--config"]).arg(&cfg).arg("--out").arg(&out).output().unwrap());
        assert!(
            line.contains(&format!("--out {}: ", out.display())) && line.contains(why),
            "{}: {line}",
            out.display()
        );
        assert!(started.elapsed() < Duration::from_secs(30), "refused only after work: {:?}", started.elapsed());
    }
    assert!(snapshot(root) == before, "a refused distill changed a file");

    // compare --out D with links in D to an experiment's files: the links are replaced, the
    // experiment's files stay as they were.
    let exp = parent();
    let report = root.join("report");
    std::fs::create_dir(&report).unwrap();
    std::os::unix::fs::symlink(exp.join("config.toml"), report.join("report.md")).unwrap();
    let weights = exp.join("checkpoints/step-4/model.safetensors");
    std::os::unix::fs::symlink(&weights, report.join("loss_vs_tokens.png")).unwrap();
    let exp_before = snapshot(exp);
    ok(host().arg("compare").arg(exp).arg("--out").arg(&report).output().unwrap());
    assert!(snapshot(exp) == exp_before, "compare wrote through a link into the experiment");
    for name in ["report.md", "loss_vs_tokens.png"] {
        let meta = std::fs::symlink_metadata(report.join(name)).unwrap();
        assert!(meta.is_file(), "{name} is still a link");
    }
    assert!(std::fs::read_to_string(report.join("report.md")).unwrap().contains('|'));
}

/// `capture --out D` wrote its shards and index to `.NAME.tmp` paths, following a link planted
/// there into the file it points at. Now a temporary is created exclusively, without following
/// links: such links, and one planted as a shard's own name, leave the files outside as they were.
#[test]
fn a_capture_replaces_a_link_planted_in_its_folder() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let cfg = project(root, 8, "");
    std::fs::write(root.join("keep.bin"), "outside the capture").unwrap();
    let features = root.join("features");
    std::fs::create_dir(&features).unwrap();
    let planted = [".shard-00000.safetensors.tmp", ".index.json.tmp", "shard-00000.safetensors"];
    for name in planted {
        std::os::unix::fs::symlink(root.join("keep.bin"), features.join(name)).unwrap();
    }
    ok(host()
        .args(["capture", "--config"])
        .arg(&cfg)
        .arg("--out")
        .arg(&features)
        .args(["--batches", "2"])
        .output()
        .unwrap());
    assert_eq!(std::fs::read_to_string(root.join("keep.bin")).unwrap(), "outside the capture");
    assert!(std::fs::symlink_metadata(features.join("shard-00000.safetensors")).unwrap().is_file(), "still a link");
    assert_eq!(
        names(&features),
        [".index.json.tmp", ".shard-00000.safetensors.tmp", "index.json", "shard-00000.safetensors"]
    );
}

/// A checkpoints folder (or one checkpoint) outside its experiment, as a bind mount shows it, is
/// still part of an experiment: no output goes into it or replaces it.
#[test]
fn a_checkpoints_folder_anywhere_is_part_of_an_experiment() {
    let dir = tempfile::tempdir().unwrap();
    let elsewhere = dir.path().join("mounted");
    std::fs::create_dir(&elsewhere).unwrap();
    for step in ["step-3", "step-4"] {
        let to = elsewhere.join(step);
        std::fs::create_dir(&to).unwrap();
        for f in std::fs::read_dir(parent().join("checkpoints").join(step)).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
        }
    }
    let before = snapshot(&elsewhere);
    for (out, why) in [
        (elsewhere.clone(), "is an experiment's checkpoints folder"),
        (elsewhere.join("cmp"), "lies inside an experiment's checkpoints folder"),
        (elsewhere.join("step-4"), "is an experiment's checkpoint"),
    ] {
        let line = refused(host().arg("compare").arg(parent()).arg("--out").arg(&out).output().unwrap());
        assert!(line.contains(why), "{}: {line}", out.display());
    }
    let line = refused(
        host()
            .args(["export", "--exp-dir"])
            .arg(parent())
            .arg("--out")
            .arg(&elsewhere)
            .arg("--force")
            .output()
            .unwrap(),
    );
    assert!(line.contains("is an experiment's checkpoints folder"), "{line}");
    assert!(snapshot(&elsewhere) == before);
}

/// `export --out D --force` checked D once, before the checkpoint loaded, and removed the old D
/// later: an experiment moved into D in between was deleted. The old D is checked again when it
/// is swapped out; holding an experiment, it is swapped back and the export fails naming it.
/// The export is caught between its check and its swap by SIGSTOP once its temporary folder
/// appears.
#[test]
fn an_experiment_moved_into_export_out_while_it_runs_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let out = root.join("zlab");
    ok(host().args(["export", "--exp-dir"]).arg(parent()).arg("--out").arg(&out).output().unwrap());
    let victim = root.join("victim");
    copy_tree(parent(), &victim);
    let victim_before = snapshot(&victim);
    let mut caught = 0;
    for _ in 0..20 {
        let mut child = host()
            .args(["export", "--exp-dir"])
            .arg(parent())
            .arg("--out")
            .arg(&out)
            .arg("--force")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let tmp = root.join(format!(".zlab.export-{}", child.id()));
        let old = inode(&out);
        let started = Instant::now();
        while !tmp.exists() && child.try_wait().unwrap().is_none() && started.elapsed() < Duration::from_secs(30) {}
        // SAFETY: signalling the child this test started.
        unsafe { libc::kill(child.id() as i32, libc::SIGSTOP) };
        // Stopped after its temporary folder appeared and before it swapped it in.
        let in_time = tmp.exists() && inode(&out) == old;
        if in_time {
            std::fs::rename(&victim, out.join("victim")).unwrap();
        }
        // SAFETY: as above.
        unsafe { libc::kill(child.id() as i32, libc::SIGCONT) };
        let result = child.wait_with_output().unwrap();
        if !in_time {
            ok(result);
            continue;
        }
        caught += 1;
        let line = refused(result);
        assert!(
            line.ends_with(&format!(
                "--out {o}: an experiment folder {o}/victim appeared in it while the export ran; {o} is left as it \
                 was and nothing was exported",
                o = out.display()
            )),
            "{line}"
        );
        let moved = out.join("victim");
        let want: Vec<_> =
            victim_before.iter().map(|(p, b)| (moved.join(p.strip_prefix(&victim).unwrap()), b.clone())).collect();
        assert!(snapshot(&moved) == want, "the experiment moved into --out changed");
        assert_eq!(names(root), ["zlab"], "a temporary folder was left");
        assert_eq!(inode(&out), old, "--out was replaced");
        break;
    }
    assert!(caught > 0, "no export was caught between its check and its swap in 20 tries");
}

fn inode(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).unwrap().ino()
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if e.file_type().unwrap().is_dir() {
            copy_tree(&src, &dst);
        } else {
            std::fs::copy(&src, &dst).unwrap();
        }
    }
}

fn fork(parent: &Path, at: u64, extra: &[&str]) -> Command {
    let mut cmd = host();
    cmd.arg("fork").arg(parent).args(["--at", &at.to_string()]).args(extra);
    cmd
}

/// Fork refusals found after the fork's folder was written (data past the end under the fork's
/// config, a tampered optimizer state kept) left the folder behind and a retry was told it
/// already exists; three forks started at once with the default name collided. Every check runs
/// before the folder appears, and the default name is claimed atomically (`-2`, `-3`).
#[test]
fn a_refused_fork_leaves_nothing_and_forks_at_once_take_their_own_names() {
    let parent = parent();
    let root = parent.parent().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // Data past the end: the parent read past 2 records by step 3.
    let past = dir.path().join("past");
    let line = refused(fork(parent, 3, &["--set", "data.max_records=2", "--exp-dir"]).arg(&past).output().unwrap());
    assert!(line.contains("data position 6 is past the end of the epoch (2 sequences)"), "{line}");
    assert!(!past.exists(), "a refused fork left {}", past.display());

    // A tampered optimizer state (its checksums recomputed) under `keep`, in a copy of the parent.
    let copy = dir.path().join("copy");
    copy_tree(parent, &copy);
    let ckpt = copy.join("checkpoints/step-2");
    tamper_optimizer_state(&ckpt);
    let tampered = dir.path().join("tampered");
    let line = refused(fork(&copy, 2, &["--optimizer-state", "keep", "--exp-dir"]).arg(&tampered).output().unwrap());
    assert!(line.contains("load_state: optimizer state `") && line.contains("shape [1], expected"), "{line}");
    assert!(!tampered.exists(), "a refused fork left {}", tampered.display());
    assert_eq!(names(dir.path()), ["copy"]);

    // Three at once, default name.
    let kids: Vec<_> =
        (0..3).map(|_| fork(parent, 2, &[]).stderr(std::process::Stdio::piped()).spawn().unwrap()).collect();
    for k in kids {
        ok(k.wait_with_output().unwrap());
    }
    let forks: Vec<String> = names(root).into_iter().filter(|n| n.starts_with("parent-fork-2")).collect();
    assert_eq!(forks, ["parent-fork-2", "parent-fork-2-2", "parent-fork-2-3"]);
    for f in &forks {
        assert!(root.join(f).join("summary.json").exists(), "{f} did not finish");
        std::fs::remove_dir_all(root.join(f)).unwrap();
    }
}

/// One tensor of `optimizer.safetensors` given another shape, the checksum recomputed.
fn tamper_optimizer_state(ckpt: &Path) {
    use plugin_api::tch::Tensor;
    let file = ckpt.join("optimizer.safetensors");
    let mut tensors = Tensor::read_safetensors(&file).unwrap();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let (name, t) = tensors.remove(0);
    tensors.push((name, t.flatten(0, -1).narrow(0, 0, 1)));
    Tensor::write_safetensors(&tensors, &file).unwrap();
    let crc = crc32c::crc32c(&std::fs::read(&file).unwrap());
    let sums = ckpt.join("checksums.json");
    let mut s: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&sums).unwrap()).unwrap();
    s["optimizer.safetensors"] = format!("{crc:08x}").into();
    std::fs::write(&sums, s.to_string()).unwrap();
}

/// A chat template that rejects a record (a `system` turn, as Mistral's does) failed `train`
/// after the experiment folder was made, without naming the record, and the rerun was told to
/// `--resume` a run that never had a step. Every split is rendered before the folder appears,
/// and the error names the file, the record and its split.
#[test]
fn a_record_the_template_rejects_is_named_before_the_experiment_exists() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let cfg = project(root, 12, "chat_template = \"strict.jinja\"");
    std::fs::write(
        root.join("strict.jinja"),
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('system turns are not supported') }}\
         {% endif %}t1 {{ m['role'] }} {{ m['content'] }} t2 {% endfor %}{% if add_generation_prompt %}t1 assistant {% endif %}",
    )
    .unwrap();
    let good = std::fs::read_to_string(root.join("chats.jsonl")).unwrap();
    let exp = root.join("runs/strict");
    // Record 4 (training split) and record 11 (the test split, read only by `eval`) each carry a
    // system turn.
    for n in [4usize, 11] {
        let mut lines: Vec<String> = good.lines().map(String::from).collect();
        let mut rec: serde_json::Value = serde_json::from_str(&lines[n - 1]).unwrap();
        rec["messages"].as_array_mut().unwrap().insert(0, serde_json::json!({"role": "system", "content": "t5"}));
        lines[n - 1] = rec.to_string();
        std::fs::write(root.join("chats.jsonl"), lines.join("\n") + "\n").unwrap();
        let line = refused(host().args(["train", "--config"]).arg(&cfg).arg("--exp-dir").arg(&exp).output().unwrap());
        let split = if n == 4 { "training" } else { "test" };
        assert!(
            line.contains(&format!("chats.jsonl: record {n} ({split} split)"))
                && line.contains("system turns are not supported"),
            "{line}"
        );
        assert!(!exp.exists(), "a refused run left {}", exp.display());
    }
    std::fs::write(root.join("chats.jsonl"), good).unwrap();
    ok(host().args(["train", "--config"]).arg(&cfg).arg("--exp-dir").arg(&exp).output().unwrap());
}
