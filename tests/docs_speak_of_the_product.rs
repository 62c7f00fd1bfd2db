//! The product speaks of itself: its docs, READMEs and sources (comments, messages) carry no marks
//! of how it was made (work sessions, calls to a remote machine, transfer folders, issue numbers),
//! and every `scripts/` path they name exists. The CUDA tests fail where they cannot run: each is
//! ignored with the reason `make gpu-test` stands for, under a name its filter (`cuda`) reaches.

use std::path::{Path, PathBuf};

mod common;

/// Phrases of a lab notebook, not of the product (matched case-insensitively). Phrases, not
/// words: a decoding "session" or a random "seed" is the product's own vocabulary.
const MARKERS: &[&str] = &[
    "lab notebook",
    "work period",
    "device call",
    "device time",
    "device machine",
    "transfer folder",
    ".devcarry",
    "target/device/",
    "carried test binary",
    "given back after",
    "seed system",
    "the issue's",
    "(issue:",
    "issue #",
    "last session",
    "earlier session",
];

/// Words that mark a notebook entry when a whole number follows: "session 6", "call 3's" (not
/// "call 0.6 ns" or "call 2x").
const NUMBERED: &[&str] = &["session", "call"];

/// Where the product's text lives, from the workspace root; folders are walked, `target` and
/// hidden folders left out.
const ROOTS: &[&str] = &[
    "docs",
    "host",
    "plugin-api",
    "kernels",
    "crates",
    "plugins",
    "plugin-template",
    "templates",
    "tests",
    "scripts",
    "configs",
    "data",
    "experiments/README.md",
    "Makefile",
    "Cargo.toml",
    ".gitignore",
];

const TEXT_EXTENSIONS: &[&str] = &["md", "rs", "cu", "cuh", "h", "c", "cpp", "py", "sh", "toml"];

/// The text files under `ROOTS` (this file excepted: it holds the markers).
fn product_files() -> Vec<PathBuf> {
    fn walk(path: &Path, out: &mut Vec<PathBuf>) {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() {
            if name == "target" || name.starts_with('.') {
                return;
            }
            let mut entries: Vec<PathBuf> = std::fs::read_dir(path).unwrap().map(|e| e.unwrap().path()).collect();
            entries.sort();
            for e in entries {
                walk(&e, out);
            }
        } else if name == "Makefile"
            || name == ".gitignore"
            || path.extension().and_then(|e| e.to_str()).is_some_and(|e| TEXT_EXTENSIONS.contains(&e))
        {
            out.push(path.to_path_buf());
        }
    }
    let root = common::root();
    let mut out = Vec::new();
    for r in ROOTS {
        walk(&root.join(r), &mut out);
    }
    out.retain(|p| !p.ends_with("tests/docs_speak_of_the_product.rs"));
    out
}

/// `file:line: text (marker)` for every marker in `text`.
fn markers_in(file: &str, text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let lower = line.to_lowercase();
        let mut hit = |what: &str| found.push(format!("{file}:{}: {} ({what})", i + 1, line.trim()));
        for m in MARKERS {
            if lower.contains(m) {
                hit(m);
            }
        }
        for w in NUMBERED {
            for (at, _) in lower.match_indices(w) {
                let before = lower[..at].chars().next_back();
                let after = lower[at + w.len()..].strip_prefix(' ').unwrap_or("");
                let digits = after.len() - after.trim_start_matches(|c: char| c.is_ascii_digit()).len();
                let rest = &after[digits..];
                let whole = digits > 0
                    && !rest.starts_with(|c: char| c.is_alphanumeric())
                    && !(rest.starts_with('.') && rest[1..].starts_with(|c: char| c.is_ascii_digit()));
                if whole && !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    hit(&format!("{w} N"));
                }
            }
        }
    }
    found
}

/// `file:line: scripts/...` for every repository script path in `text` that does not exist.
fn missing_script_paths(file: &str, text: &str) -> Vec<String> {
    let root = common::root();
    let path_char = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    let mut missing = Vec::new();
    for (i, line) in text.lines().enumerate() {
        for (at, _) in line.match_indices("scripts/") {
            if line[..at].chars().next_back().is_some_and(path_char) {
                continue; // a path inside another folder
            }
            let path: String = line[at..].chars().take_while(|&c| path_char(c)).collect();
            let path = path.trim_end_matches(['.', ',']);
            if !root.join(path).exists() {
                missing.push(format!("{file}:{}: {path}", i + 1));
            }
        }
    }
    missing
}

fn relative(p: &Path) -> String {
    p.strip_prefix(common::root()).unwrap_or(p).display().to_string()
}

#[test]
fn docs_and_sources_carry_no_notebook_markers() {
    let files = product_files();
    assert!(files.len() > 200, "only {} files found", files.len());
    let found: Vec<String> =
        files.iter().flat_map(|p| markers_in(&relative(p), &std::fs::read_to_string(p).unwrap_or_default())).collect();
    assert!(found.is_empty(), "notebook markers (the product speaks of itself):\n{}", found.join("\n"));
}

#[test]
fn every_script_path_named_in_docs_and_sources_exists() {
    let missing: Vec<String> = product_files()
        .iter()
        .flat_map(|p| missing_script_paths(&relative(p), &std::fs::read_to_string(p).unwrap_or_default()))
        .collect();
    assert!(missing.is_empty(), "script paths that are not in the repository:\n{}", missing.join("\n"));
}

#[test]
fn the_readme_carries_no_notebook_markers() {
    let text = std::fs::read_to_string(common::root().join("README.md")).unwrap();
    let found = markers_in("README.md", &text);
    assert!(found.is_empty(), "notebook markers in the README:\n{}", found.join("\n"));
    let missing = missing_script_paths("README.md", &text);
    assert!(missing.is_empty(), "script paths that are not in the repository:\n{}", missing.join("\n"));
}

#[test]
fn the_marker_checks_catch_what_they_are_for() {
    let text = "the session's cache, seed 3\nas in session 6 of the notes\nrecall 3; a call 0.6 ns, 2x\n\
                the device call\ncall 4's run\n";
    let found = markers_in("x.md", text);
    let lines: Vec<&str> = found.iter().map(|f| f.split(' ').next().unwrap()).collect();
    assert_eq!(lines, ["x.md:2:", "x.md:4:", "x.md:5:"], "{found:?}");
    let missing = missing_script_paths("x.md", "run scripts/setup/setup.sh, then scripts/nope.sh. a/scripts/x");
    assert_eq!(missing, ["x.md:1: scripts/nope.sh"]);
}

/// Every CUDA test is `#[ignore = "needs a CUDA device: make gpu-test"]` (so `make test` reports it
/// ignored, not passed) and reached by `make gpu-test`'s filter: `cuda` in its name or module
/// (`cuda_tests.rs`). Conversely, every function that asks for the test device carries that ignore.
#[test]
fn cuda_tests_are_ignored_and_reached_by_make_gpu_test() {
    const IGNORE: &str = r#"#[ignore = "needs a CUDA device: make gpu-test"]"#;
    let mut wrong = Vec::new();
    let mut cuda_tests = 0;
    for p in product_files().iter().filter(|p| p.extension().is_some_and(|e| e == "rs")) {
        let text = std::fs::read_to_string(p).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        let in_cuda_module = p.file_stem().is_some_and(|s| s == "cuda_tests");
        let mut fn_line = None;
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            if t.starts_with("fn ") || t.starts_with("pub fn ") {
                fn_line = Some(i);
            }
            if t.starts_with("#[ignore") && t.contains("CUDA") {
                cuda_tests += 1;
                if t != IGNORE {
                    wrong.push(format!("{}:{}: `{t}`, not `{IGNORE}`", relative(p), i + 1));
                }
                let name = lines[i..].iter().find_map(|l| l.trim_start().strip_prefix("fn ")).unwrap_or("");
                if !name.contains("cuda") && !in_cuda_module {
                    wrong.push(format!("{}:{}: `fn {name}`: no `cuda` in its name", relative(p), i + 1));
                }
            }
            if t.contains("cuda_test_device()") && !t.starts_with("pub fn") && !t.starts_with("//") {
                let f = fn_line.unwrap_or(0);
                let attrs = lines[..f]
                    .iter()
                    .rev()
                    .take_while(|l| l.trim_start().starts_with("#["))
                    .any(|l| l.trim() == IGNORE);
                if !attrs {
                    wrong.push(format!("{}:{}: asks for the CUDA test device without `{IGNORE}`", relative(p), i + 1));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(cuda_tests >= 11, "only {cuda_tests} CUDA tests found");
}
