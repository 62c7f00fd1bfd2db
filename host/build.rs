//! Give `dflash-host` an RPATH to libtorch so it runs without LD_LIBRARY_PATH: the local cache
//! ($LIBTORCH) and the GPU machine's torch install. And record the git revision the
//! binary is built from, for manifests and `--version` (read at build time: at run time the
//! current folder may be any repository, or none).

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let mut dirs = vec!["$ORIGIN".to_string()];
    if let Ok(lt) = std::env::var("LIBTORCH") {
        // As written: a plugin scaffold built with the same text reuses torch-sys's build.
        println!("cargo:rustc-env=DFLASH_BUILD_LIBTORCH={lt}");
        dirs.push(format!("{lt}/lib"));
        dirs.push(format!("{lt}/../nvidia/cu13/lib"));
    }
    let gpu = "/opt/torch/.venv/lib/python3.12/site-packages";
    dirs.push(format!("{gpu}/torch/lib"));
    dirs.push(format!("{gpu}/nvidia/cu13/lib"));
    for d in dirs {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{d}");
    }
    git_revision();
}

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok().filter(|o| o.status.success())?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string()).filter(|s| !s.is_empty())
}

fn git_revision() {
    let rev = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=DFLASH_GIT_REVISION={rev}");
    // Build again when HEAD moves: HEAD itself, the branch it points at, packed refs (those that
    // exist: a path that does not would make cargo run this again on every build).
    println!("cargo:rerun-if-changed=build.rs");
    if let (Some(git_dir), Some(common)) = (git(&["rev-parse", "--git-dir"]), git(&["rev-parse", "--git-common-dir"])) {
        let branch = git(&["symbolic-ref", "-q", "HEAD"]);
        let watched = [format!("{git_dir}/HEAD"), format!("{common}/packed-refs")]
            .into_iter()
            .chain(branch.map(|b| format!("{common}/{b}")));
        for path in watched.filter(|p| std::path::Path::new(p).exists()) {
            println!("cargo:rerun-if-changed={path}");
        }
    }
}
