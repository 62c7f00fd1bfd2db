//! Models by name, offline: a tiny random HF folder written into an HF hub cache layout
//! (`models--Org--Tiny/{blobs, refs/main, snapshots/<commit>/}` with the snapshot's files
//! symlinked to blobs, as `huggingface_hub` writes it) under `$HF_HUB_CACHE`; `path = "Org/Tiny"`
//! loads it, `revision` picks a commit, and a model in no cache with no network fails with one
//! line naming the repository and the folder looked in.

use plugin_api::tch::{Device, Kind};
use std::path::{Path, PathBuf};
use target_hf::{hub, HfTarget};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// The rope fixture's tiny Llama (weights, tokenizer, default config) as one cached snapshot.
fn write_cache(cache: &Path) -> PathBuf {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/target_llama_rope");
    let repo = cache.join("models--Org--Tiny");
    let snapshot = repo.join("snapshots").join(COMMIT);
    for d in [repo.join("blobs"), repo.join("refs"), snapshot.clone()] {
        std::fs::create_dir_all(d).unwrap();
    }
    for (name, src) in [
        ("config.json", "config.default.json"),
        ("model.safetensors", "model.safetensors"),
        ("tokenizer.json", "tokenizer.json"),
    ] {
        let blob = repo.join("blobs").join(format!("blob-{name}"));
        std::fs::copy(fixture.join(src), &blob).unwrap();
        std::os::unix::fs::symlink(&blob, snapshot.join(name)).unwrap();
    }
    std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
    snapshot
}

#[test]
fn a_hub_name_loads_from_the_cache_and_a_missing_one_says_where_it_looked() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("hub");
    let snapshot = write_cache(&cache);
    // One test in this binary: the variables are set before anything reads them.
    std::env::set_var("HF_HUB_CACHE", &cache);
    std::env::set_var("HF_ENDPOINT", "http://127.0.0.1:9"); // the discard port: no network
    assert_eq!(hub::cache_dir(), cache);

    let not_here = dir.path().join("Org/Tiny");
    let path = hub::target_path("Org/Tiny", not_here.clone(), None).unwrap();
    assert_eq!(path, snapshot);
    assert_eq!(hub::target_path("Org/Tiny", not_here.clone(), Some(COMMIT)).unwrap(), snapshot);
    let t = HfTarget::load(&path, Device::Cpu, Kind::Float, 1).unwrap();
    assert_eq!((t.spec.architecture.as_str(), t.spec.num_hidden_layers), ("llama", 2));
    assert_eq!(t.spec.source.as_str(), snapshot.to_str().unwrap(), "the snapshot is what a run records");

    // A local folder of that name wins over the hub, and takes no revision.
    std::fs::create_dir_all(&not_here).unwrap();
    assert_eq!(hub::target_path("Org/Tiny", not_here.clone(), None).unwrap(), not_here);
    let err = hub::target_path("Org/Tiny", not_here, Some("main")).unwrap_err();
    assert!(err.contains("field `revision`"), "{err}");

    // Not cached: one line naming the field, the name and revision, the local path tried, the
    // repository's folder in the cache and what chose it, and why; then the download's failure.
    for (repo, revision, why) in [
        ("Org/Missing", None, "no such folder"),
        ("Org/Tiny", Some("v2"), "it has no refs/v2, and `v2` is not a commit hash"),
    ] {
        let local = dir.path().join("elsewhere").join(repo);
        let err = hub::target_path(repo, local.clone(), revision).unwrap_err();
        let looked = cache.join(format!("models--{}", repo.replace('/', "--")));
        assert!(!err.contains('\n'), "one line: {err}");
        let want = format!(
            "field `path`: `{repo}` (revision `{}`) is not a local path ({}: no such file or folder) and not in the HF \
             hub cache (looked in {}, from $HF_HUB_CACHE: {why}); downloading it failed: ",
            revision.unwrap_or("main"),
            local.display(),
            looked.display()
        );
        assert!(err.starts_with(&want), "{err}\nshould start with\n{want}");
    }
    // HF_HUB_OFFLINE: the cache only, and the error says why nothing was downloaded.
    std::env::set_var("HF_HUB_OFFLINE", "1");
    let err = hub::target_path("Org/Missing", dir.path().join("x"), None).unwrap_err();
    assert!(err.ends_with("; not downloaded, as HF_HUB_OFFLINE is set"), "{err}");
    assert_eq!(hub::target_path("Org/Tiny", dir.path().join("x"), None).unwrap(), snapshot);
}
