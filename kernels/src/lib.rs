//! Fused CUDA kernels for dflash. Empty for now: the CPU path uses libtorch ops.
