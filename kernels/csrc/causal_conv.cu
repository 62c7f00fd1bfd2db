// A Gated DeltaNet layer's short causal conv with its SiLU (crates/gated_deltanet/src/conv.rs),
// forward only, in one pass: out[b, t, c] = silu(sum_j w[c, j] row(b, t + j, c)), where the rows
// are the K-1 rows of history followed by x. The libtorch composite is
// a concatenation, a multiply, K-1 fused multiply-adds and the SiLU, each a pass over the whole
// tensor; here each input element is read once and the sum is fp32 (rounded to bf16 once).
//
// Compiled at run time by NVRTC (kernels/src/causal_conv.rs) with -DK=... One thread a channel
// and T consecutive steps, its K-1 previous rows kept in registers; a warp reads consecutive
// channels of one row. x rows may be strided (a column slice of the input projections).

typedef unsigned short bf16;

#define THREADS 128
#define T 32

__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float(((unsigned)x) << 16); }

__device__ __forceinline__ bf16 to_bf16(float x) {  // round to nearest even, NaN kept
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return 0x7fc0u;
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// hist [B, K-1, C] dense; x [B, L, C] with batch stride xb and row stride xt (channels
// dense); w [C, K] dense; out [B, L, C] dense.
extern "C" __global__ void __launch_bounds__(THREADS) causal_conv_silu(
    const bf16* hist, const bf16* x, long long xb, long long xt, const bf16* w, bf16* out, int L, int C) {
    const int c = blockIdx.x * THREADS + threadIdx.x, t0 = blockIdx.y * T, b = blockIdx.z;
    if (c >= C) return;
    float wj[K], win[K];  // win[j]: row t + j of the concatenated rows, for the step t at hand
#pragma unroll
    for (int j = 0; j < K; j++) wj[j] = to_f32(w[(long long)c * K + j]);
    const bf16* xs = x + b * xb + c;
    // Row s of history | x (s < K-1: history).
#define ROW(s) to_f32((s) < K - 1 ? hist[((long long)b * (K - 1) + (s)) * C + c] : xs[(long long)((s) - (K - 1)) * xt])
#pragma unroll
    for (int j = 0; j < K - 1; j++) win[j] = ROW(t0 + j);
    bf16* o = out + ((long long)b * L) * C + c;
    const int end = min(t0 + T, L);
    for (int t = t0; t < end; t++) {
        win[K - 1] = ROW(t + K - 1);
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < K; j++) acc += wj[j] * win[j];
        o[(long long)t * C] = to_bf16(acc / (1.f + expf(-acc)));
#pragma unroll
        for (int j = 0; j < K - 1; j++) win[j] = win[j + 1];
    }
#undef ROW
}
