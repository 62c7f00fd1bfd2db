//! Give `dflash-host` an RPATH to libtorch so it runs without LD_LIBRARY_PATH: the local cache
//! ($LIBTORCH) and the GPU machine's torch install (STACK.md).

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let mut dirs = vec!["$ORIGIN".to_string()];
    if let Ok(lt) = std::env::var("LIBTORCH") {
        dirs.push(format!("{lt}/lib"));
        dirs.push(format!("{lt}/../nvidia/cu13/lib"));
    }
    let gpu = "/opt/torch/.venv/lib/python3.12/site-packages";
    dirs.push(format!("{gpu}/torch/lib"));
    dirs.push(format!("{gpu}/nvidia/cu13/lib"));
    for d in dirs {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{d}");
    }
}
