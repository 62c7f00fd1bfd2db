//! Compile the c10d shim (csrc/c10d.cpp: TCPStore, Gloo, collectives; libtorch_cpu only) into
//! this crate, and the NCCL one (csrc/c10d_nccl.cpp) into a shared library of its own whose
//! bytes the crate embeds and loads only when CUDA is (it needs libtorch_cuda.so).
//!
//! The NCCL library needs NCCL's, the CUDA runtime's and CCCL's headers, which the torch wheel
//! does not ship: scripts/setup/setup.sh puts them in $DFLASH_CACHE/cuda-headers (`DFLASH_CUDA_HEADERS`
//! overrides). Without them the build still succeeds, and an NCCL group
//! fails at run time saying so.

use std::{path::PathBuf, process::Command};

fn main() {
    for f in ["csrc/c10d.cpp", "csrc/c10d_nccl.cpp", "csrc/decls"] {
        println!("cargo:rerun-if-changed={f}");
    }
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=DFLASH_CUDA_HEADERS");
    let libtorch = PathBuf::from(std::env::var("LIBTORCH").expect("LIBTORCH (the libtorch folder, as for torch-sys)"));
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    let torch_includes = [libtorch.join("include"), libtorch.join("include/torch/csrc/api/include")];

    let mut b = cc::Build::new();
    b.cpp(true).file("csrc/c10d.cpp").include("csrc/decls").define("USE_C10D_GLOO", None);
    for i in &torch_includes {
        b.include(i);
    }
    b.flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .warnings(false)
        .compile("dflash_c10d");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");

    // The NCCL library, or an empty file where the headers are missing.
    let lib = out.join("libdflash_c10d_nccl.so");
    println!("cargo:rerun-if-env-changed=DFLASH_CACHE");
    let headers =
        match (std::env::var_os("DFLASH_CUDA_HEADERS"), std::env::var_os("DFLASH_CACHE"), std::env::var_os("HOME")) {
            (Some(h), _, _) => PathBuf::from(h),
            (None, Some(c), _) => PathBuf::from(c).join("cuda-headers"),
            (None, None, home) => PathBuf::from(home.unwrap_or_default()).join(".cache/dflash/cuda-headers"),
        };
    println!("cargo:rerun-if-changed={}", headers.display());
    let cuda = headers.join("nvidia/cu13/include");
    let includes = [cuda.clone(), cuda.join("cccl"), headers.join("nvidia/nccl/include")];
    let missing: Vec<_> =
        [headers.join("nvidia/nccl/include/nccl.h"), cuda.join("crt/host_config.h"), cuda.join("cuda_runtime_api.h")]
            .into_iter()
            .filter(|p| !p.exists())
            .collect();
    if !missing.is_empty() {
        println!(
            "cargo:warning=NCCL process groups disabled: missing {} (`make setup` installs them)",
            missing[0].display()
        );
        std::fs::write(&lib, b"").unwrap();
        return;
    }
    let compiler = b.get_compiler();
    let mut cmd = Command::new(compiler.path());
    cmd.args(["-std=c++17", "-O2", "-fPIC", "-shared", "-w", "-D_GLIBCXX_USE_CXX11_ABI=1", "-DGLOG_USE_GLOG_EXPORT"])
        .args(["-DUSE_C10D_NCCL", "-DUSE_CUDA", "-Icsrc/decls"])
        .args(torch_includes.iter().chain(&includes).map(|i| format!("-I{}", i.display())))
        .arg("csrc/c10d_nccl.cpp")
        .arg("-o")
        .arg(&lib)
        .arg(format!("-L{}", libtorch.join("lib").display()))
        // Name libtorch_cuda.so even though --as-needed would drop it: loading this library
        // must fail where CUDA's libraries are missing, not at the first NCCL call.
        .args(["-Wl,--no-as-needed", "-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10"]);
    let status = cmd.status().expect("running the C++ compiler for csrc/c10d_nccl.cpp");
    assert!(status.success(), "compiling csrc/c10d_nccl.cpp failed: {cmd:?}");
}
