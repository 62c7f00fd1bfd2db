//! Models by name: a target `path` such as `Qwen/Qwen3-8B` (an `owner/name` that is not a local
//! path) is a Hugging Face Hub repository, found where `huggingface_hub` keeps it:
//! `<hub cache>/models--Owner--Name/snapshots/<commit>/`, the commit named by `refs/<revision>`
//! (`main` unless the config gives `revision`, which may also be a commit hash). The hub cache
//! is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//! `~/.cache/huggingface/hub`, as `huggingface_hub` resolves it, so a model downloaded by
//! Python is used as it is. A model not there is downloaded into that cache (the `hf-hub`
//! crate: the same layout, `$HF_TOKEN` or the cache's `token` file for gated models); without
//! a network the error names the repository and the folder looked in.

use std::path::{Path, PathBuf};

/// The files of a repository a target needs: config, tokenizer, chat template, safetensors
/// weights (not `.bin` / `.pt` / `.gguf` copies, nor anything in subfolders).
fn wanted(file: &str) -> bool {
    !file.contains('/')
        && (matches!(
            file,
            "config.json"
                | "generation_config.json"
                | "tokenizer.json"
                | "tokenizer_config.json"
                | "special_tokens_map.json"
                | "chat_template.jinja"
        ) || file.ends_with(".safetensors")
            || file == "model.safetensors.index.json")
}

/// Whether `s` reads as a hub repository id: `owner/name`, each part letters, digits, `-`, `_`,
/// `.`, not starting with `.` or `-` (HF's rule), nothing else.
pub fn is_repo_id(s: &str) -> bool {
    let part = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && !p.starts_with(['.', '-'])
            && !p.contains("..")
            && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(s.split_once('/'), Some((owner, name)) if part(owner) && part(name))
}

/// The hub cache folder, as `huggingface_hub` picks it.
pub fn cache_dir() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(d) = var("HF_HUB_CACHE") {
        return d;
    }
    if let Some(d) = var("HF_HOME") {
        return d.join("hub");
    }
    let cache = var("XDG_CACHE_HOME")
        .or_else(|| var("HOME").map(|h| h.join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("huggingface").join("hub")
}

/// `models--Owner--Name` in `cache`.
pub fn repo_folder(cache: &Path, repo: &str) -> PathBuf {
    cache.join(format!("models--{}", repo.replace('/', "--")))
}

/// The snapshot of `repo` at `revision` (a branch or tag named by `refs/`, or a commit hash)
/// in `cache`, if it is there with a `config.json`; None for anything else (see [`lookup`]).
pub fn cached(cache: &Path, repo: &str, revision: Option<&str>) -> Option<PathBuf> {
    lookup(cache, repo, revision).ok().flatten()
}

/// [`cached`], telling a snapshot that is not there (`Ok(None)`: download it) from one that is
/// there but broken: a `refs/` file or `config.json` that is a FIFO, a device or too large is an
/// error naming it, read without blocking.
pub fn lookup(cache: &Path, repo: &str, revision: Option<&str>) -> Result<Option<PathBuf>, String> {
    let folder = repo_folder(cache, repo);
    let revision = revision.unwrap_or("main");
    let is_hash = revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit());
    let ref_file = folder.join("refs").join(revision);
    let commit = match input_files::read_optional(&ref_file, input_files::limits::HUB_REF) {
        Ok(Some(hash)) => hash.trim().to_string(),
        Ok(None) if is_hash => revision.to_string(),
        Ok(None) => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    if commit.is_empty() || commit.contains(['/', '\\']) || commit.starts_with('.') {
        return Ok(None);
    }
    let snapshot = folder.join("snapshots").join(commit);
    match input_files::check_path(&snapshot.join("config.json")) {
        Ok(input_files::PathKind::File) => Ok(Some(snapshot)),
        Err(input_files::InputError::NotFound { .. }) => Ok(None),
        Ok(input_files::PathKind::Dir) => Err(format!("{}: a directory", snapshot.join("config.json").display())),
        Err(e) => Err(e.to_string()),
    }
}

/// The snapshot folder of `repo`: from the cache, else downloaded into it. The error is one
/// line naming the repository, the folder looked in and why the download failed.
pub fn resolve(repo: &str, revision: Option<&str>) -> Result<PathBuf, String> {
    let cache = cache_dir();
    if let Some(snapshot) = lookup(&cache, repo, revision)? {
        return Ok(snapshot);
    }
    let looked = repo_folder(&cache, repo);
    download(&cache, repo, revision).map_err(|e| {
        format!(
            "`{repo}` is not a local path and not in the HF hub cache (looked in {}), and downloading it failed: {e}",
            looked.display()
        )
    })
}

fn download(cache: &Path, repo: &str, revision: Option<&str>) -> Result<PathBuf, String> {
    use hf_hub::{api::sync::ApiBuilder, Cache, Repo, RepoType};
    let mut builder = ApiBuilder::from_cache(Cache::new(cache.to_path_buf())).with_progress(true);
    if let Some(token) = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()) {
        builder = builder.with_token(Some(token));
    }
    if let Some(endpoint) = std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()) {
        builder = builder.with_endpoint(endpoint);
    }
    let api = builder.build().map_err(|e| e.to_string())?;
    let revision = revision.unwrap_or("main").to_string();
    let handle = api.repo(Repo::with_revision(repo.to_string(), RepoType::Model, revision));
    let info = handle.info().map_err(|e| e.to_string())?;
    let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).filter(|f| wanted(f)).collect();
    if !files.contains(&"config.json") || !files.iter().any(|f| f.ends_with(".safetensors")) {
        return Err("the repository has no config.json and *.safetensors (for a GGUF, give the file's path)".into());
    }
    eprintln!("downloading {repo} ({} files) into {}", files.len(), repo_folder(cache, repo).display());
    let mut snapshot = None;
    for f in files {
        let path = handle.get(f).map_err(|e| format!("{f}: {e}"))?;
        snapshot = path.parent().map(Path::to_path_buf);
    }
    snapshot.ok_or_else(|| "nothing downloaded".to_string())
}

/// A target's `path` as the plugin opens it: `resolved` (the config value against the config's
/// folder) when it exists or `raw` is no repository id; otherwise the hub snapshot.
pub fn target_path(raw: &str, resolved: PathBuf, revision: Option<&str>) -> Result<PathBuf, String> {
    if resolved.exists() || !is_repo_id(raw) {
        if revision.is_some() {
            return Err(format!("field `revision`: `{raw}` is a local path, not a hub repository"));
        }
        return Ok(resolved);
    }
    resolve(raw, revision)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_are_owner_slash_name() {
        for ok in ["Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct", "HuggingFaceTB/SmolLM2-135M", "a/b.c_d"] {
            assert!(is_repo_id(ok), "{ok}");
        }
        for bad in [
            "model.gguf",
            "./a/b",
            "a/b/c",
            "/abs/path",
            "../x",
            "a/..",
            "a/.hidden",
            "owner/",
            "a b/c",
            "$DFLASH_CACHE/x",
        ] {
            assert!(!is_repo_id(bad), "{bad}");
        }
    }

    #[test]
    fn snapshots_follow_refs_or_a_commit() {
        let cache = tempfile::tempdir().unwrap();
        let folder = repo_folder(cache.path(), "Org/Tiny");
        assert!(folder.ends_with("models--Org--Tiny"));
        let (main, old) = ("a".repeat(40), "b".repeat(40));
        for c in [&main, &old] {
            std::fs::create_dir_all(folder.join("snapshots").join(c)).unwrap();
            std::fs::write(folder.join("snapshots").join(c).join("config.json"), "{}").unwrap();
        }
        assert_eq!(cached(cache.path(), "Org/Tiny", None), None, "no refs/main yet");
        std::fs::create_dir_all(folder.join("refs")).unwrap();
        std::fs::write(folder.join("refs/main"), format!("{main}\n")).unwrap();
        assert_eq!(cached(cache.path(), "Org/Tiny", None), Some(folder.join("snapshots").join(&main)));
        assert_eq!(cached(cache.path(), "Org/Tiny", Some(&old)), Some(folder.join("snapshots").join(&old)));
        assert_eq!(cached(cache.path(), "Org/Tiny", Some("v2")), None, "no such ref");
        assert_eq!(cached(cache.path(), "Org/Other", None), None);
        std::fs::write(folder.join("refs/evil"), "../../x").unwrap();
        assert_eq!(cached(cache.path(), "Org/Tiny", Some("evil")), None);
        // A FIFO as `refs/main` (was a hang) or a snapshot's `config.json` linked to /dev/zero:
        // an error naming the file, not a download and not a wait.
        std::fs::remove_file(folder.join("refs/main")).unwrap();
        assert!(std::process::Command::new("mkfifo").arg(folder.join("refs/main")).status().unwrap().success());
        let err = lookup(cache.path(), "Org/Tiny", None).unwrap_err();
        assert_eq!(err, format!("{}: not a regular file (a FIFO)", folder.join("refs/main").display()));
        let config = folder.join("snapshots").join(&old).join("config.json");
        std::fs::remove_file(&config).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &config).unwrap();
        let err = lookup(cache.path(), "Org/Tiny", Some(&old)).unwrap_err();
        assert!(err.starts_with(&format!("{}: not a regular file (a character device", config.display())), "{err}");
    }

    #[test]
    fn only_what_a_target_reads_is_downloaded() {
        for f in [
            "config.json",
            "tokenizer.json",
            "model-00001-of-00004.safetensors",
            "model.safetensors.index.json",
            "chat_template.jinja",
        ] {
            assert!(wanted(f), "{f}");
        }
        for f in
            ["pytorch_model.bin", "model.gguf", "original/consolidated.00.pth", "README.md", "onnx/model.safetensors"]
        {
            assert!(!wanted(f), "{f}");
        }
    }
}
