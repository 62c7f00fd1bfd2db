//! Models by name: a target `path` such as `Qwen/Qwen3-8B` (an `owner/name` that is not a local
//! path) is a Hugging Face Hub repository, found where `huggingface_hub` keeps it:
//! `<hub cache>/models--Owner--Name/snapshots/<commit>/`, the commit named by `refs/<revision>`
//! (`main` unless the config gives `revision`, which may also be a commit hash). The hub cache
//! is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
//! `~/.cache/huggingface/hub`, as `huggingface_hub` resolves it, so a model downloaded by
//! Python or the `hf` CLI is used as it is. [`locate`] is the one lookup: the target plugin opens
//! what it finds, and the host checks a config with it before anything loads. A model not there
//! is downloaded into that cache when the plugin opens it (the `hf-hub` crate: the same layout,
//! `$HF_TOKEN` or the cache's `token` file for gated models), unless `HF_HUB_OFFLINE` is set;
//! the error then names the repository, the revision, the folder looked in and why it failed.

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

pub use input_files::is_hub_repo_id as is_repo_id;

/// The hub cache folder, and what chose it (for messages).
#[derive(Debug, Clone, PartialEq)]
pub struct CacheDir {
    pub path: PathBuf,
    /// `$HF_HUB_CACHE`, `$HF_HOME/hub`, `$XDG_CACHE_HOME/huggingface/hub` or
    /// `~/.cache/huggingface/hub`.
    pub chosen_by: &'static str,
}

/// The hub cache folder, as `huggingface_hub` picks it.
pub fn cache() -> CacheDir {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let (path, chosen_by) = if let Some(d) = var("HF_HUB_CACHE") {
        (d, "$HF_HUB_CACHE")
    } else if let Some(d) = var("HF_HOME") {
        (d.join("hub"), "$HF_HOME/hub")
    } else if let Some(d) = var("XDG_CACHE_HOME") {
        (d.join("huggingface").join("hub"), "$XDG_CACHE_HOME/huggingface/hub")
    } else {
        let home = var("HOME").map(|h| h.join(".cache")).unwrap_or_else(|| PathBuf::from(".cache"));
        (home.join("huggingface").join("hub"), "~/.cache/huggingface/hub")
    };
    CacheDir { path, chosen_by }
}

/// The hub cache folder's path (see [`cache`]).
pub fn cache_dir() -> PathBuf {
    cache().path
}

/// `HF_HUB_OFFLINE` is set (`1`, `true`, `yes`, `on`), as `huggingface_hub` reads it: the cache
/// only, no download.
pub fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

/// `models--Owner--Name` in `cache`.
pub fn repo_folder(cache: &Path, repo: &str) -> PathBuf {
    cache.join(format!("models--{}", repo.replace('/', "--")))
}

/// The snapshot of `repo` at `revision` (a branch or tag named by `refs/`, or a commit hash)
/// in `cache`, as (commit, folder), if it is there with a `config.json`; else why not.
pub fn lookup(cache: &Path, repo: &str, revision: Option<&str>) -> Result<(String, PathBuf), String> {
    let folder = repo_folder(cache, repo);
    if !folder.is_dir() {
        return Err("no such folder".into());
    }
    let revision = revision.unwrap_or("main");
    let is_commit = revision.len() == 40 && revision.chars().all(|c| c.is_ascii_hexdigit());
    // Read without blocking and size-capped: a FIFO or device in the cache is named, not waited on.
    let commit = match input_files::read_optional(&folder.join("refs").join(revision), input_files::limits::HUB_REF) {
        Ok(Some(hash)) => hash.trim().to_string(),
        Ok(None) if is_commit => revision.to_string(),
        Ok(None) => return Err(format!("it has no refs/{revision}, and `{revision}` is not a commit hash")),
        Err(e) => return Err(e.to_string()),
    };
    if commit.is_empty() || commit.contains(['/', '\\']) || commit.starts_with('.') {
        return Err(format!("its refs/{revision} names no commit"));
    }
    let snapshot = folder.join("snapshots").join(&commit);
    let config = snapshot.join("config.json");
    match input_files::check_path(&config) {
        Ok(input_files::PathKind::File) => Ok((commit, snapshot)),
        Err(input_files::InputError::NotFound { .. }) => Err(format!("its snapshot {commit} has no config.json")),
        Ok(input_files::PathKind::Dir) => Err(format!("{}: a directory", config.display())),
        Err(e) => Err(e.to_string()),
    }
}

/// The snapshot folder of `repo` at `revision` in `cache`, if it is there (see [`lookup`]).
pub fn cached(cache: &Path, repo: &str, revision: Option<&str>) -> Option<PathBuf> {
    lookup(cache, repo, revision).ok().map(|(_, snapshot)| snapshot)
}

/// Where a target's `path` leads, without downloading anything: what the target plugin opens
/// and what the host checks before it loads (both through [`locate`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Location {
    /// A local file or folder: the config value against the config's folder (it may be missing,
    /// which whoever opens it reports).
    Local(PathBuf),
    /// A hub repository's snapshot in the HF cache.
    Snapshot { repo: String, revision: String, commit: String, path: PathBuf },
    /// A hub repository the cache does not hold (at that revision): downloaded when the target
    /// is opened, unless `HF_HUB_OFFLINE` is set.
    NotCached(NotCached),
}

/// What [`locate`] tried for a hub name it did not find.
#[derive(Debug, Clone, PartialEq)]
pub struct NotCached {
    pub repo: String,
    pub revision: String,
    /// The local path the name did not name.
    pub local: PathBuf,
    /// The repository's folder in the hub cache, and what chose the cache.
    pub looked_in: PathBuf,
    pub chosen_by: &'static str,
    /// Why the snapshot is not there.
    pub why: String,
}

impl std::fmt::Display for NotCached {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(
            f,
            "`{}` (revision `{}`) is not a local path ({}: no such file or folder) and not in the HF hub cache \
             (looked in {}, from {}: {})",
            self.repo,
            self.revision,
            self.local.display(),
            self.looked_in.display(),
            self.chosen_by,
            self.why
        )
    }
}

/// Where the `[target]` `path` value `raw` leads: `resolved` (the value against the config's
/// folder) when it exists or `raw` is no repository id; otherwise the hub cache's snapshot of
/// `raw` at `revision`, or what was tried. Err (naming the field) for a `revision` given with
/// a local path.
pub fn locate(raw: &str, resolved: PathBuf, revision: Option<&str>) -> Result<Location, String> {
    if resolved.exists() || !is_repo_id(raw) {
        if revision.is_some() {
            return Err(format!(
                "field `revision`: `{raw}` is a local path ({}), not a hub repository",
                resolved.display()
            ));
        }
        return Ok(Location::Local(resolved));
    }
    let cache = cache();
    let revision_shown = revision.unwrap_or("main").to_string();
    Ok(match lookup(&cache.path, raw, revision) {
        Ok((commit, path)) => Location::Snapshot { repo: raw.into(), revision: revision_shown, commit, path },
        Err(why) => Location::NotCached(NotCached {
            repo: raw.into(),
            revision: revision_shown,
            local: resolved,
            looked_in: repo_folder(&cache.path, raw),
            chosen_by: cache.chosen_by,
            why,
        }),
    })
}

/// A target's `path` as the plugin opens it ([`locate`]), a hub model not in the cache
/// downloaded into it. The error is one line naming the field, what was looked for and where,
/// and why the download failed (or that `HF_HUB_OFFLINE` forbade it).
pub fn target_path(raw: &str, resolved: PathBuf, revision: Option<&str>) -> Result<PathBuf, String> {
    match locate(raw, resolved, revision)? {
        Location::Local(path) | Location::Snapshot { path, .. } => Ok(path),
        Location::NotCached(missing) if offline() => {
            Err(format!("field `path`: {missing}; not downloaded, as HF_HUB_OFFLINE is set"))
        }
        Location::NotCached(missing) => download(&cache_dir(), raw, revision)
            .map_err(|e| format!("field `path`: {missing}; downloading it failed: {e}")),
    }
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
