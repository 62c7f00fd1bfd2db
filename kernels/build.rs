//! Compile the small C++ shims in csrc/ (cuDNN attention forward, autograd backward with output
//! gradients, fused AdamW and the clip's multi-tensor scaling, the Kineto profiler) against libtorch's headers ($LIBTORCH, as
//! torch-sys does).

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
}
