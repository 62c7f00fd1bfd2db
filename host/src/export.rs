//! `dflash-host export`: a checkpoint as a z-lab format drafter (the DFlash paper: config.json +
//! model.safetensors in bf16, no embedding / LM head), which SGLang and vLLM serve, which
//! `[drafter] init_from = DIR` reads back, and which transformers loads with
//! `AutoModel.from_pretrained(DIR, trust_remote_code=True)` through the `dflash.py` it ships
//! (the file `auto_map` names; written for this project, see docs/SERVING.md). The config is the
//! one the drafter trained with: its `max_position_embeddings`, `rope_theta` and `rope_scaling`
//! are the target's (the drafter took them from the target when the run started), `layer_types`
//! and `sliding_window` the layers'. A README.md model card says how to serve it ([`card`]).
//!
//! The checkpoint is opened and verified first (the finder every reader uses), and every tensor
//! checked against the shapes its config.json implies. `--out` goes through the output guard (no
//! experiment in it, around it, or under it, `--force` or not), may be a non-empty folder only
//! with `--force`, and is replaced whole: the export is written under a temporary name beside it
//! and swapped in with one `renameat2(RENAME_EXCHANGE)`, so `--out` always names a whole export;
//! what a kill leaves (a temporary folder, or on a file system without the exchange the old
//! export stepped aside) is cleaned up or put back by the next export to the same `--out`.

pub mod card;

use crate::outputs::rename_at;
use crate::{
    experiment::{checkpoint, guard},
    plugins::Registry,
};
use anyhow::{bail, Context, Result};
use plugin_api::{
    tch::{Kind, Tensor},
    PluginKind,
};
use std::{
    ffi::CString,
    os::{fd::AsRawFd, unix::ffi::OsStrExt},
    path::{Path, PathBuf},
};

/// The modeling file an export ships for transformers' `AutoModel` (`auto_map` names it).
pub const MODELING_FILE: &str = "dflash.py";
const MODELING: &str = include_str!("export/dflash.py");

/// What an export of an experiment wrote.
#[derive(Debug)]
pub struct Exported {
    /// The checkpoint folder exported.
    pub checkpoint: PathBuf,
    /// `--out`, absolute.
    pub out: PathBuf,
    /// The SGLang and vLLM command lines that serve it from `out` (those of its model card), as
    /// plain text.
    pub serving: String,
}

/// Export checkpoint `step` of `exp_dir` (default: the newest that verifies) to `out`, with a
/// model card.
pub fn export_experiment(
    exp_dir: &Path,
    step: Option<u64>,
    out: &Path,
    force: bool,
    registry: &Registry,
) -> Result<Exported> {
    let abs = guard::check_out_folder("--out", out, &[])?;
    let ckpt = checkpoint::find(exp_dir, step)?;
    let card = card::model_card(exp_dir, &ckpt, out, registry)?;
    write(&ckpt, out, force, Some(&card.text), &[], registry)?;
    // The card's lines as they run here: the drafter at `--out` itself, the target where the
    // servers find it from this machine, as a shell takes them (no code fences).
    let lines = card.serving.lines_here(&abs.display().to_string());
    let serving = lines.lines().filter(|l| !l.starts_with("```")).collect::<Vec<_>>().join("\n");
    Ok(Exported { checkpoint: ckpt.dir, out: abs, serving })
}

/// Write the checkpoint folder `checkpoint`'s drafter to `out` in the z-lab format, without a
/// model card.
pub fn export(checkpoint: &Path, out: &Path, force: bool, registry: &Registry) -> Result<()> {
    let inputs = [guard::Input::new("the checkpoint", checkpoint)];
    guard::check_out_folder("--out", out, &inputs)?;
    write(&checkpoint::open_dir(checkpoint)?, out, force, None, &inputs, registry)
}

/// The checkpoint's weights against the shapes its config.json implies, as the drafter plugin
/// whose config it is says (ABI `saved_shapes`: the config's sizes bounded and consistent). A
/// drafter no plugin here claims is exported as it is, with a warning.
fn check_config(ckpt: &checkpoint::Opened, arch: &str, registry: &Registry) -> Result<()> {
    let file = ckpt.dir.join("config.json");
    let drafters = registry.plugins.iter().filter(|p| p.record.kind == PluginKind::Drafter.as_str());
    for plugin in drafters {
        let Some(shapes) = plugin.saved_shapes(&ckpt.config_json).with_context(|| format!("{}", file.display()))?
        else {
            continue;
        };
        let declared: Vec<_> = shapes.into_iter().map(|(name, shape)| (name, shape, Kind::Float)).collect();
        return checkpoint::check_declared(&ckpt.weights_file(), &ckpt.weights, &declared);
    }
    tracing::warn!(
        "{}: drafter `{arch}` is none of this binary's plugins': its tensors are exported unchecked against its config",
        file.display()
    );
    Ok(())
}

/// The export itself (see the module doc).
fn write(
    ckpt: &checkpoint::Opened,
    out: &Path,
    force: bool,
    card: Option<&str>,
    inputs: &[guard::Input],
    registry: &Registry,
) -> Result<()> {
    let out = check_out(out, force)?;
    let mut cfg: serde_json::Value = serde_json::from_str(&ckpt.config_json)?;
    let arch = cfg["architectures"][0].as_str().unwrap_or("?").to_string();
    check_config(ckpt, &arch, registry)?;
    // transformers 5's name for the weights' dtype (4.x wrote `torch_dtype`; both read back).
    if let Some(obj) = cfg.as_object_mut() {
        obj.remove("torch_dtype");
    }
    cfg["dtype"] = "bfloat16".into();
    // Only z-lab's architecture is servable, and only it has a modeling file here.
    let zlab = arch == "DFlashDraftModel";
    if zlab {
        cfg["auto_map"] = serde_json::json!({"AutoModel": "dflash.DFlashDraftModel"});
    } else {
        tracing::warn!(
            "{}: drafter `{arch}` is not z-lab's DFlashDraftModel: the folder keeps its own config.json and bf16 weights \
             (its plugin's `init_from` reads it back); SGLang and vLLM cannot serve it",
            ckpt.dir.display()
        );
    }
    let sliding = cfg["layer_types"].as_array().is_some_and(|t| t.iter().any(|l| l == "sliding_attention"));
    if let (true, Some(w), Some(block)) = (sliding, cfg["sliding_window"].as_u64(), cfg["block_size"].as_u64()) {
        if w < block {
            tracing::warn!(
                "{}: `sliding_window` {w} is shorter than `block_size` {block}: SGLang and vLLM run a sliding layer \
                 causal over positions p-{w}+1..=p, which also cuts a block's own keys older than the window, \
                 where training saw them; expect a lower acceptance length served than `eval` measures",
                ckpt.dir.display()
            );
        }
    }
    let bf16: Vec<(String, Tensor)> =
        ckpt.weights.iter().map(|nt| (nt.name.to_string(), nt.tensor.tensor().to_kind(Kind::BFloat16))).collect();

    let parent = out.parent().expect("check_out gives a path with a parent");
    let name = out.file_name().expect("check_out gives a path with a name").to_string_lossy().to_string();
    let tmp = parent.join(format!(".{name}.export-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let written = (|| -> Result<()> {
        std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        crate::atomic_write::write_synced(
            &tmp.join("config.json"),
            (serde_json::to_string_pretty(&cfg)? + "\n").as_bytes(),
        )?;
        if let Some(card) = card {
            crate::atomic_write::write_synced(&tmp.join("README.md"), card.as_bytes())?;
        }
        if zlab {
            crate::atomic_write::write_synced(&tmp.join(MODELING_FILE), MODELING.as_bytes())?;
        }
        let model = tmp.join("model.safetensors");
        Tensor::write_safetensors(&bf16, &model).with_context(|| format!("writing {}", model.display()))?;
        std::fs::File::open(&model)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("syncing {}", model.display()))?;
        std::fs::File::open(&tmp).and_then(|d| d.sync_all()).with_context(|| format!("syncing {}", tmp.display()))
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    publish(&tmp, &out, inputs)
}

fn unsupported(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOSYS))
}

/// Put the finished `tmp` at `out`, both names in one folder held open. An existing `out` is
/// swapped with `tmp` in one step; what it held is then, under the temporary name where nobody
/// writes, checked by the output guard again before it is removed: an experiment (or an input)
/// that was moved into `out` while the export ran is swapped back, the new export removed, and
/// the export fails naming it. Where the file system cannot swap, `out` steps aside to
/// `.NAME.replaced-PID` first (checked the same way) and `tmp` takes its place; a kill between the
/// two leaves the old export there, which the next export puts back ([`recover`]).
fn publish(tmp: &Path, out: &Path, inputs: &[guard::Input]) -> Result<()> {
    let parent_path = out.parent().expect("check_out gives a path with a parent");
    let parent = crate::outputs::open_dir(parent_path)?;
    let fd = parent.as_raw_fd();
    let c = |p: &Path| CString::new(p.file_name().expect("a name").as_bytes()).map_err(anyhow::Error::new);
    let (tmp_name, out_name) = (c(tmp)?, c(out)?);
    let renamed =
        |e: std::io::Error| anyhow::Error::new(e).context(format!("renaming {} to {}", tmp.display(), out.display()));
    // What the old `out`, now at `held`, holds that must not go: None, or the refusal.
    let refusal = |held: &Path| -> Option<String> {
        let found = guard::find_under(held, inputs, guard::MAX_SCANNED);
        let what = match found {
            Ok(None) => return None,
            Ok(Some(f)) => f.what().replace(&held.display().to_string(), &out.display().to_string()),
            Err(e) => format!("{e:#}"),
        };
        Some(format!(
            "--out {o}: {what} appeared in it while the export ran; {o} is left as it was and nothing was exported",
            o = out.display()
        ))
    };
    let exists = out.symlink_metadata().is_ok();
    if exists {
        match rename_at(fd, &tmp_name, fd, &out_name, libc::RENAME_EXCHANGE) {
            Ok(()) => {
                if let Some(why) = refusal(tmp) {
                    rename_at(fd, &tmp_name, fd, &out_name, libc::RENAME_EXCHANGE).map_err(renamed)?;
                    let _ = std::fs::remove_dir_all(tmp); // the new export
                    bail!("{why}");
                }
                let _ = std::fs::remove_dir_all(tmp); // the old export
            }
            Err(e) if unsupported(&e) => {
                let name = out.file_name().expect("a name").to_string_lossy();
                let old = parent_path.join(format!(".{name}.replaced-{}", std::process::id()));
                let old_name = c(&old)?;
                rename_at(fd, &out_name, fd, &old_name, libc::RENAME_NOREPLACE)
                    .or_else(|e| if unsupported(&e) { rename_at(fd, &out_name, fd, &old_name, 0) } else { Err(e) })
                    .with_context(|| format!("moving {} aside", out.display()))?;
                if let Some(why) = refusal(&old) {
                    rename_at(fd, &old_name, fd, &out_name, 0)
                        .with_context(|| format!("putting {} back", out.display()))?;
                    let _ = std::fs::remove_dir_all(tmp);
                    bail!("{why}");
                }
                rename_at(fd, &tmp_name, fd, &out_name, 0).map_err(renamed)?;
                let _ = std::fs::remove_dir_all(&old);
            }
            Err(e) => return Err(renamed(e)),
        }
    } else {
        match rename_at(fd, &tmp_name, fd, &out_name, libc::RENAME_NOREPLACE) {
            Ok(()) => {}
            Err(e) if unsupported(&e) => rename_at(fd, &tmp_name, fd, &out_name, 0).map_err(renamed)?,
            Err(e) => {
                let _ = std::fs::remove_dir_all(tmp);
                return Err(renamed(e));
            }
        }
    }
    parent.sync_all().with_context(|| format!("syncing {}", parent_path.display()))
}

/// Whether process `pid` is alive (it may be another user's).
fn alive(pid: i32) -> bool {
    // SAFETY: kill(pid, 0) only asks whether the process exists.
    pid > 0
        && (unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM))
}

/// What exports to `name` in `parent` killed part-way left: their temporary folders are removed
/// (an export that dies leaves `.NAME.export-PID` beside `--out`, never a partial `--out`); an
/// old export stepped aside (`.NAME.replaced-PID`, only where the file system cannot swap two
/// folders) goes back to `--out` when `--out` is missing, else is removed. A live export's are
/// left alone.
pub fn recover(parent: &Path, name: &str) -> Result<()> {
    let out = parent.join(name);
    let Ok(entries) = std::fs::read_dir(parent) else { return Ok(()) };
    let mut left: Vec<(PathBuf, bool)> = entries
        .flatten()
        .filter_map(|e| {
            let file = e.file_name();
            let rest = file.to_str()?.strip_prefix('.')?.strip_prefix(name)?.strip_prefix('.')?.to_string();
            let (replaced, pid) = match rest.split_once('-')? {
                ("replaced", pid) => (true, pid),
                ("export", pid) => (false, pid),
                _ => return None,
            };
            (!alive(pid.parse().ok()?)).then(|| (e.path(), replaced))
        })
        .collect();
    left.sort_by_key(|(_, replaced)| !replaced); // the old export first: it may be put back
    for (path, replaced) in left {
        if replaced && out.symlink_metadata().is_err() {
            std::fs::rename(&path, &out).with_context(|| format!("putting {} back", path.display()))?;
            tracing::warn!(
                "{} was missing: put back the export {} held (an export was killed while replacing it)",
                out.display(),
                path.display()
            );
        } else if let Some(found) = guard::find_under(&path, &[], guard::MAX_SCANNED).unwrap_or(None) {
            // An export killed before it could swap back what it found in `--out`: kept.
            tracing::warn!("{}, left by an export that did not finish, {}: kept", path.display(), found.refusal());
        } else {
            tracing::info!("removing {}, left by an export that did not finish", path.display());
            let _ = std::fs::remove_dir_all(&path);
        }
    }
    Ok(())
}

/// `out` as an absolute path whose parent exists, after what a killed export left is recovered:
/// not a file, not a non-empty folder unless `force` (the guard has run).
fn check_out(out: &Path, force: bool) -> Result<PathBuf> {
    let name = out.file_name().with_context(|| format!("--out {}: not a folder name", out.display()))?;
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let parent = parent.canonicalize().with_context(|| format!("{}", parent.display()))?;
    recover(&parent, &name.to_string_lossy())?;
    let out_abs = parent.join(name);
    if out_abs.exists() {
        if !out_abs.is_dir() {
            bail!("--out {}: exists and is not a folder", out.display());
        }
        let empty = std::fs::read_dir(&out_abs).with_context(|| format!("reading {}", out.display()))?.next().is_none();
        if !empty && !force {
            bail!("--out {}: exists and is not empty; pass --force to replace it", out.display());
        }
    }
    Ok(out_abs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builtins() -> Registry {
        Registry::new(&[]).unwrap()
    }
    use crate::experiment::Experiment;
    use plugin_api::{tch::Device, NamedTensor};

    /// A one-tensor checkpoint of an architecture export does not check (it keeps this test
    /// about the folder rules).
    fn checkpoint(root: &Path) -> PathBuf {
        let exp = Experiment::create(&root.join("exp"), "", &serde_json::json!({})).unwrap();
        let w = vec![NamedTensor::new("fc.weight", Tensor::ones([4, 4], (Kind::Float, Device::Cpu)))];
        exp.save_checkpoint(3, &w, "{\"architectures\": [\"TestDraftModel\"]}", &[], &serde_json::json!({}), 1).unwrap()
    }

    fn listing(dir: &Path) -> Vec<String> {
        let mut n: Vec<String> =
            std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        n.sort();
        n
    }

    #[test]
    fn export_never_writes_into_the_experiment_and_replaces_only_with_force() {
        let root = tempfile::tempdir().unwrap();
        let ckpt = checkpoint(root.path());
        let before = std::fs::read(ckpt.join("model.safetensors")).unwrap();
        for inside in [ckpt.clone(), root.path().join("exp"), root.path().join("exp/zlab"), root.path().to_path_buf()] {
            let err = export(&ckpt, &inside, true, &builtins()).unwrap_err().to_string();
            assert!(err.contains("experiment"), "{}: {err}", inside.display());
        }
        assert_eq!(std::fs::read(ckpt.join("model.safetensors")).unwrap(), before, "the checkpoint was touched");
        checkpoint::verify(&ckpt).unwrap();

        let out = root.path().join("zlab");
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("notes.txt"), "mine").unwrap();
        let err = export(&ckpt, &out, false, &builtins()).unwrap_err().to_string();
        assert!(err.contains("exists and is not empty; pass --force"), "{err}");
        assert_eq!(listing(&out), ["notes.txt"]);
        export(&ckpt, &out, true, &builtins()).unwrap();
        assert_eq!(listing(&out), ["config.json", "model.safetensors"]);
        assert_eq!(listing(root.path()), ["exp", "zlab"], "no temporary folder left behind");
        let back = Tensor::read_safetensors(out.join("model.safetensors")).unwrap();
        assert_eq!(back[0].1.kind(), Kind::BFloat16);
    }

    /// `--out` always names a whole export while it is replaced: readers polling it never find
    /// it missing (the swap is one rename; two renames leave a moment without it, which these
    /// readers see within a few dozen replacements).
    #[test]
    fn a_replaced_export_is_never_missing() {
        let root = tempfile::tempdir().unwrap();
        let ckpt = checkpoint(root.path());
        let out = root.path().join("zlab");
        export(&ckpt, &out, false, &builtins()).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (out, stop) = (out.clone(), stop.clone());
                std::thread::spawn(move || {
                    let (mut looks, mut missing) = (0u64, 0u64);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        missing += u64::from(out.symlink_metadata().is_err());
                        looks += 1;
                    }
                    (looks, missing)
                })
            })
            .collect();
        for _ in 0..60 {
            export(&ckpt, &out, true, &builtins()).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for r in readers {
            let (looks, missing) = r.join().unwrap();
            assert!(looks > 0);
            assert_eq!(missing, 0, "--out was missing {missing} of {looks} times while it was replaced");
        }
        assert_eq!(listing(&out), ["config.json", "model.safetensors"]);
        assert_eq!(listing(root.path()), ["exp", "zlab"]);
    }

    /// What a kill between two renames leaves (where the file system cannot swap folders): the
    /// old export aside, the new one under its temporary name, `--out` missing. The next export
    /// puts the old one back before anything else.
    #[test]
    fn an_export_killed_while_replacing_is_put_back_by_the_next() {
        let root = tempfile::tempdir().unwrap();
        let ckpt = checkpoint(root.path());
        let out = root.path().join("zlab");
        export(&ckpt, &out, false, &builtins()).unwrap();
        let old = root.path().join(".zlab.replaced-2147483646");
        std::fs::rename(&out, &old).unwrap();
        std::fs::create_dir(root.path().join(".zlab.export-2147483646")).unwrap();
        let live = root.path().join(format!(".zlab.export-{}", std::os::unix::process::parent_id()));
        std::fs::create_dir(&live).unwrap();
        let err = export(&ckpt, &out, false, &builtins()).unwrap_err().to_string();
        assert!(err.contains("exists and is not empty"), "{err}");
        assert_eq!(listing(&out), ["config.json", "model.safetensors"]);
        assert_eq!(
            listing(root.path()),
            [
                ".zlab.export-".to_string() + &std::os::unix::process::parent_id().to_string(),
                "exp".into(),
                "zlab".into()
            ]
        );
        std::fs::remove_dir(&live).unwrap();
    }

    #[test]
    fn a_corrupt_checkpoint_is_not_exported() {
        let root = tempfile::tempdir().unwrap();
        let ckpt = checkpoint(root.path());
        let model = ckpt.join("model.safetensors");
        let mut bytes = std::fs::read(&model).unwrap();
        let n = bytes.len();
        bytes[n - 1] ^= 0x40; // one flipped bit in the weights: still a valid safetensors file
        std::fs::write(&model, bytes).unwrap();
        let out = root.path().join("zlab");
        let err = format!("{:#}", export(&ckpt, &out, false, &builtins()).unwrap_err());
        assert!(err.contains("model.safetensors: checksum mismatch"), "{err}");
        assert!(!out.exists());
        let err = format!(
            "{:#}",
            export_experiment(&root.path().join("exp"), Some(3), &out, false, &builtins()).unwrap_err()
        );
        assert!(err.contains("checkpoint step-3 is not usable"), "{err}");
    }
}
