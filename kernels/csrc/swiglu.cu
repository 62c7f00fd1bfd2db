// The SwiGLU product of an MLP, h = silu(gate) * up, and its backward in one pass each: the
// composite of libtorch ops it replaces reads and writes the [tokens, ffn] tensors five times
// more (silu, the product, the recomputed product, two gradient products and silu's backward).
//
// Compiled at run time by NVRTC (kernels/src/swiglu.rs); bf16 in and out, fp32 inside. Tensors
// dense and 16-byte aligned, n a multiple of 8: each thread moves 8 elements at a time.

// (bf16, load8, bf16_bits, store8: csrc/bf16x8.cuh, put in front of this file.)

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

// h = silu(gate) * up over n elements.
extern "C" __global__ void swiglu_forward(const bf16* gate, const bf16* up, bf16* h, long long n) {
    for (long long i = 8 * ((long long)blockIdx.x * blockDim.x + threadIdx.x); i < n; i += 8LL * gridDim.x * blockDim.x) {
        float g[8], u[8], y[8];
        load8(gate + i, g);
        load8(up + i, u);
#pragma unroll
        for (int j = 0; j < 8; j++) y[j] = g[j] * sigmoid(g[j]) * u[j];
        store8(h + i, y);
    }
}

// From dh = dLoss/dh: h again (the down projection's weight gradient needs it), d_gate =
// dh * up * silu'(gate) and d_up = dh * silu(gate), silu'(x) = s(x) (1 + x (1 - s(x))).
extern "C" __global__ void swiglu_backward(const bf16* gate, const bf16* up, const bf16* dh, bf16* h, bf16* d_gate,
                                           bf16* d_up, long long n) {
    for (long long i = 8 * ((long long)blockIdx.x * blockDim.x + threadIdx.x); i < n; i += 8LL * gridDim.x * blockDim.x) {
        float g[8], u[8], d[8], y[8], dg[8], du[8];
        load8(gate + i, g);
        load8(up + i, u);
        load8(dh + i, d);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float s = sigmoid(g[j]), act = g[j] * s;
            y[j] = act * u[j];
            du[j] = d[j] * act;
            dg[j] = d[j] * u[j] * s * (1.f + g[j] * (1.f - s));
        }
        store8(h + i, y);
        store8(d_gate + i, dg);
        store8(d_up + i, du);
    }
}
