//! The README as a new user reads it: every `dflash-host ...` command in its code blocks is one
//! the CLI accepts, and every path of this repository it names is there.

use clap::Parser;
use dflash_host::cli::Cli;
use std::path::Path;

mod common;

fn readme() -> String {
    std::fs::read_to_string(common::root().join("README.md")).unwrap()
}

/// The lines of the fenced code blocks, continuation lines (`\`) joined.
fn code_lines(text: &str) -> Vec<String> {
    let (mut out, mut in_block, mut pending) = (Vec::new(), false, String::new());
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if !in_block {
            continue;
        }
        match line.trim_end().strip_suffix('\\') {
            Some(head) => pending.push_str(head),
            None => {
                pending.push_str(line);
                out.push(std::mem::take(&mut pending));
            }
        }
    }
    out
}

/// Shell words (single and double quotes), up to an unquoted ` #` comment.
fn words(line: &str) -> Vec<String> {
    let (mut out, mut cur, mut quote, mut any) = (Vec::new(), String::new(), None, false);
    let mut prev_space = true;
    for c in line.chars() {
        match (quote, c) {
            (None, '#') if prev_space => break,
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (Some(q), _) if c == q => quote = None,
            (None, c) if c.is_whitespace() => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            _ => {
                cur.push(c);
                any = true;
            }
        }
        prev_space = quote.is_none() && c.is_whitespace();
    }
    if any {
        out.push(cur);
    }
    out
}

#[test]
fn every_dflash_host_command_in_the_readme_parses() {
    let mut n = 0;
    for line in code_lines(&readme()) {
        let argv = words(&line);
        let Some(first) = argv.first() else { continue };
        if !first.ends_with("dflash-host") {
            continue;
        }
        n += 1;
        if let Err(e) = Cli::try_parse_from(&argv) {
            panic!("README: `{line}` does not parse:\n{e}");
        }
    }
    assert!(n >= 20, "only {n} commands found");
    // The parser this relies on refuses what the CLI refuses.
    assert!(Cli::try_parse_from(["dflash-host", "train", "--config", "x.toml", "--sett", "a=1"]).is_err());
    assert_eq!(words("a 'b c' \"d\" # e"), ["a", "b c", "d"]);
}

#[test]
fn every_repository_path_the_readme_names_exists() {
    const TOP: [&str; 10] = [
        "host",
        "plugins",
        "crates",
        "configs",
        "docs",
        "scripts",
        "tests",
        "kernels",
        "plugin-api",
        "plugin-template",
    ];
    let text = readme();
    let mut candidates: Vec<String> = Vec::new();
    // `code`, [links](path) and the words of code blocks.
    for (i, part) in text.split('`').enumerate() {
        if i % 2 == 1 {
            candidates.extend(part.split_whitespace().map(str::to_string));
        }
    }
    for part in text.split("](").skip(1) {
        candidates.extend(part.split(')').next().map(str::to_string));
    }
    for line in code_lines(&text) {
        candidates.extend(words(&line));
    }
    let mut checked = 0;
    for c in candidates {
        let c = c.trim_matches(|ch: char| ",.;:()\"'".contains(ch));
        let first = c.split('/').next().unwrap_or("");
        if !TOP.contains(&first) || !c.contains('/') || c.contains(['<', '*', '{', '[', '$']) || c.contains("...") {
            continue;
        }
        let path = common::root().join(c.trim_end_matches('/'));
        assert!(path.exists(), "README names {c}, which is not in the repository");
        checked += 1;
    }
    assert!(checked >= 30, "only {checked} paths checked");
    assert!(Path::new(&common::root().join("docs/CONFIG.md")).exists());
}
