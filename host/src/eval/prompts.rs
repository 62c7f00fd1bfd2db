//! Prompt sets for `eval`: public benchmark files turned into chat prompts for the data plugin,
//! and the name a non-default set gives its results file.

use anyhow::{anyhow, Result};
use std::path::{Path, PathBuf};

/// A private folder for converted prompts.
pub fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("dflash-eval-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| anyhow!("{}: {e}", dir.display()))?;
    Ok(dir)
}

/// A file-name-safe name for a non-default prompt set (None for `holdout`).
pub fn prompts_name(source: &str) -> Option<String> {
    (source != "holdout").then(|| {
        let stem = Path::new(source).file_stem().and_then(|s| s.to_str()).unwrap_or(source);
        stem.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect()
    })
}

/// Prompt files of public benchmarks, read by the host into chat prompts (one user turn each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PromptFormat {
    /// Chat records as `[data]` reads them (a record ending with a user turn is a prompt).
    Chat,
    /// MT-Bench's question.jsonl: `{"turns": ["...", "..."]}` (the first turn).
    MtBench,
    /// GSM8K: `{"question": "...", "answer": "..."}`.
    Gsm8k,
    /// Alpaca: `{"instruction": "...", "input": "..."}` (input appended after a blank line).
    Alpaca,
}

/// As `--prompt-format` names it (`mt-bench`), for logs.
impl std::fmt::Display for PromptFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v = clap::ValueEnum::to_possible_value(self).expect("no variant is skipped");
        f.write_str(v.get_name())
    }
}

/// One benchmark record's prompt text.
fn benchmark_prompt(format: PromptFormat, v: &serde_json::Value) -> Result<String> {
    let text = |key: &str| v.get(key).and_then(|t| t.as_str()).map(str::to_string);
    match format {
        PromptFormat::MtBench => v
            .get("turns")
            .and_then(|t| t.as_array())
            .and_then(|t| t.first())
            .and_then(|t| t.as_str())
            .map(str::to_string)
            .ok_or_else(|| anyhow!("no `turns` list of strings")),
        PromptFormat::Gsm8k => text("question").ok_or_else(|| anyhow!("no `question` string")),
        PromptFormat::Alpaca => {
            let instruction = text("instruction").ok_or_else(|| anyhow!("no `instruction` string"))?;
            Ok(match text("input").filter(|i| !i.trim().is_empty()) {
                Some(input) => format!("{instruction}\n\n{input}"),
                None => instruction,
            })
        }
        PromptFormat::Chat => unreachable!("chat files go to the data plugin as they are"),
    }
}

/// A benchmark file (JSONL, or a JSON array) as chat JSONL prompts in `out`; errors name the
/// file and line.
pub fn convert_prompts(path: &Path, format: PromptFormat, out: &Path) -> Result<usize> {
    let text = input_files::read_to_string_capped(path, 1 << 30)?;
    let records: Vec<(usize, serde_json::Value)> = if text.trim_start().starts_with('[') {
        let all: Vec<serde_json::Value> =
            serde_json::from_str(&text).map_err(|e| anyhow!("{}: {e}", path.display()))?;
        all.into_iter().enumerate().map(|(i, v)| (i + 1, v)).collect()
    } else {
        let mut v = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            v.push((i + 1, serde_json::from_str(line).map_err(|e| anyhow!("{}:{}: {e}", path.display(), i + 1))?));
        }
        v
    };
    let mut lines = String::new();
    for (at, v) in &records {
        let prompt =
            benchmark_prompt(format, v).map_err(|e| anyhow!("{}:{at}: {e} ({format:?} format)", path.display()))?;
        lines.push_str(&serde_json::json!({"messages": [{"role": "user", "content": prompt}]}).to_string());
        lines.push('\n');
    }
    std::fs::write(out, lines).map_err(|e| anyhow!("{}: {e}", out.display()))?;
    Ok(records.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn benchmark_files_become_prompts() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("p.jsonl");
        for (format, text, want) in [
            (
                PromptFormat::MtBench,
                "{\"question_id\": 81, \"turns\": [\"Write a poem.\", \"Now shorter.\"]}\n",
                "Write a poem.",
            ),
            (PromptFormat::Gsm8k, "{\"question\": \"2+2?\", \"answer\": \"4\"}\n", "2+2?"),
            (PromptFormat::Alpaca, "[{\"instruction\": \"Sum\", \"input\": \"1 2\", \"output\": \"3\"}]", "Sum\n\n1 2"),
        ] {
            let file = dir.path().join("in.json");
            std::fs::write(&file, text).unwrap();
            assert_eq!(convert_prompts(&file, format, &out).unwrap(), 1);
            let line: serde_json::Value = serde_json::from_str(std::fs::read_to_string(&out).unwrap().trim()).unwrap();
            assert_eq!(line["messages"][0]["content"], want);
            assert_eq!(line["messages"].as_array().unwrap().len(), 1, "a prompt-only record");
        }
        let file = dir.path().join("bad.jsonl");
        std::fs::write(&file, "{\"question\": \"a\"}\n{\"q\": 1}\n").unwrap();
        let e = convert_prompts(&file, PromptFormat::Gsm8k, &out).unwrap_err().to_string();
        assert!(e.contains("bad.jsonl:2: no `question` string"), "{e}");
    }
}
