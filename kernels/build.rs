//! Compile the small C++ shims in csrc/ (cuDNN attention forward, autograd backward with output
//! gradients, fused AdamW and the clip's multi-tensor scaling, the Kineto profiler) against libtorch's headers ($LIBTORCH, as
//! torch-sys does), and the CUDA graph shim (csrc/cuda_graph.cpp) into a shared library of its own
//! whose bytes the crate embeds and loads only when a graph is asked for (it needs libtorch_cuda.so
//! and the CUDA runtime's headers, which `make setup` puts in $DFLASH_CACHE/cuda-headers;
//! `DFLASH_CUDA_HEADERS` overrides). Without the headers the build still succeeds, and decoding
//! runs without graphs.

use std::{path::PathBuf, process::Command};

fn main() {
    println!("cargo:rerun-if-changed=csrc/cudnn_attention.cpp");
    println!("cargo:rerun-if-changed=csrc/profiler.cpp");
    println!("cargo:rerun-if-changed=csrc/fused_adamw.cpp");
    println!("cargo:rerun-if-changed=csrc/autograd.cpp");
    println!("cargo:rerun-if-changed=csrc/memory_stats.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let libtorch =
        std::path::PathBuf::from(std::env::var("LIBTORCH").expect("LIBTORCH (the libtorch folder, as for torch-sys)"));
    cc::Build::new()
        .cpp(true)
        .file("csrc/cudnn_attention.cpp")
        .file("csrc/profiler.cpp")
        .file("csrc/fused_adamw.cpp")
        .file("csrc/autograd.cpp")
        .file("csrc/memory_stats.cpp")
        .include(libtorch.join("include"))
        .include(libtorch.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .warnings(false)
        .compile("dflash_torch_shim");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    cuda_graph_library(&libtorch);
}

/// csrc/cuda_graph.cpp as `$OUT_DIR/libdflash_cuda_graph.so`, or an empty file where the CUDA
/// headers are missing.
fn cuda_graph_library(libtorch: &std::path::Path) {
    println!("cargo:rerun-if-changed=csrc/cuda_graph.cpp");
    println!("cargo:rerun-if-env-changed=DFLASH_CUDA_HEADERS");
    println!("cargo:rerun-if-env-changed=DFLASH_CACHE");
    let lib = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("libdflash_cuda_graph.so");
    let headers =
        match (std::env::var_os("DFLASH_CUDA_HEADERS"), std::env::var_os("DFLASH_CACHE"), std::env::var_os("HOME")) {
            (Some(h), _, _) => PathBuf::from(h),
            (None, Some(c), _) => PathBuf::from(c).join("cuda-headers"),
            (None, None, home) => PathBuf::from(home.unwrap_or_default()).join(".cache/dflash/cuda-headers"),
        };
    let cuda = headers.join("nvidia/cu13/include");
    println!("cargo:rerun-if-changed={}", cuda.display());
    if !cuda.join("cuda_runtime_api.h").exists() {
        println!("cargo:warning=CUDA graphs disabled: missing {} (`make setup` installs it)", cuda.display());
        std::fs::write(&lib, b"").unwrap();
        return;
    }
    let includes =
        [libtorch.join("include"), libtorch.join("include/torch/csrc/api/include"), cuda.clone(), cuda.join("cccl")];
    let compiler = cc::Build::new().cpp(true).get_compiler();
    let mut cmd = Command::new(compiler.path());
    cmd.args(["-std=c++17", "-O2", "-fPIC", "-shared", "-w", "-D_GLIBCXX_USE_CXX11_ABI=1", "-DGLOG_USE_GLOG_EXPORT"])
        .args(["-DUSE_CUDA"])
        .args(includes.iter().map(|i| format!("-I{}", i.display())))
        .arg("csrc/cuda_graph.cpp")
        .arg("-o")
        .arg(&lib)
        .arg(format!("-L{}", libtorch.join("lib").display()))
        .args(["-Wl,--no-as-needed", "-ltorch_cuda", "-lc10_cuda", "-ltorch_cpu", "-lc10"]);
    let status = cmd.status().expect("running the C++ compiler for csrc/cuda_graph.cpp");
    assert!(status.success(), "compiling csrc/cuda_graph.cpp failed: {cmd:?}");
}
