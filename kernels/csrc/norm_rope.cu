// A Qwen3 attention's per-head RMSNorm of q or k followed by its rotary embedding, in one pass
// each way: the libtorch ops it replaces take a pass for the norm, three for RoPE (the half swap,
// the scale, the multiply-add) and their autograd backward a dozen more, with layout copies.
//
// Compiled at run time by NVRTC (kernels/src/norm_rope.rs) with -DD=..; bf16 in and out, fp32
// inside. One warp a row of D elements (a head of a position): lane l holds elements
// l*V..l*V+V-1, V = D / 32, so the rotary partner of an element (D / 2 away) sits in lane l ^ 16.
// Rows are (batch, position, head) in that order, D elements each, dense; the tables cos and
// signed sin ([-sin, sin]) are [B, L, D] dense, one row a (batch, position).

typedef unsigned short bf16;

#define V (D / 32)
#define WARPS 8

__device__ __forceinline__ void loadv(const bf16* p, float* x) {
#pragma unroll
    for (int i = 0; i < V / 2; i++) {
        const unsigned u = reinterpret_cast<const unsigned*>(p)[i];
        x[2 * i] = __uint_as_float(u << 16);
        x[2 * i + 1] = __uint_as_float(u & 0xffff0000u);
    }
}

__device__ __forceinline__ unsigned bf16_bits(float x) {  // round to nearest even, NaN kept
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ void storev(bf16* p, const float* x) {
#pragma unroll
    for (int i = 0; i < V / 2; i++) reinterpret_cast<unsigned*>(p)[i] = bf16_bits(x[2 * i]) | (bf16_bits(x[2 * i + 1]) << 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// 1 / rms of the warp's row (this lane's V elements in xv).
__device__ __forceinline__ float inverse_rms(const float* xv, float eps) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < V; i++) ss += xv[i] * xv[i];
    return rsqrtf(warp_sum(ss) / D + eps);
}

// y = rope(w * x / rms(x)) for `rows` rows of x; `heads` rows share a table row.
extern "C" __global__ void __launch_bounds__(32 * WARPS) norm_rope_forward(
    const bf16* x, const bf16* w, const bf16* cos, const bf16* ssin, bf16* y, long long rows, int heads, float eps) {
    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * WARPS;
    float wv[V];
    loadv(w + lane * V, wv);
    for (long long row = (long long)blockIdx.x * WARPS + threadIdx.x / 32; row < rows; row += warps) {
        const long long at = row * D + lane * V, table = row / heads * D + lane * V;
        float xv[V], c[V], s[V], out[V];
        loadv(x + at, xv);
        const float r = inverse_rms(xv, eps);
        loadv(cos + table, c);
        loadv(ssin + table, s);
#pragma unroll
        for (int i = 0; i < V; i++) {
            const float y0 = xv[i] * r * wv[i];
            out[i] = y0 * c[i] + __shfl_xor_sync(0xffffffffu, y0, 16) * s[i];
        }
        storev(y + at, out);
    }
}

// From dy = dLoss/dy (rows at dy + b*db + l*dl + h*dh, `len` positions a batch row): dx (dense,
// as x) and this CTA's share of dLoss/dw in dw_part[blockIdx.x] (fp32, D; the caller sums them).
// With g = dLoss/d(w * xn), the rotation transposed: g = dy * cos + swap(dy * ssin); dw = sum g * xn;
// dx = r (g w - xn mean(g w xn)).
extern "C" __global__ void __launch_bounds__(32 * WARPS) norm_rope_backward(
    const bf16* x, const bf16* w, const bf16* cos, const bf16* ssin,
    const bf16* dy, long long db, long long dl, long long dh,
    bf16* dx, float* dw_part, long long rows, int heads, int len, float eps) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    __shared__ float red[WARPS][D];
    const long long warps = (long long)gridDim.x * WARPS;
    float wv[V], acc[V];
    loadv(w + lane * V, wv);
#pragma unroll
    for (int i = 0; i < V; i++) acc[i] = 0.f;
    for (long long row = (long long)blockIdx.x * WARPS + warp; row < rows; row += warps) {
        const long long pos = row / heads, h = row % heads, b = pos / len, l = pos % len;
        const long long at = row * D + lane * V, table = pos * D + lane * V;
        float xv[V], c[V], s[V], d[V], g[V];
        loadv(x + at, xv);
        const float r = inverse_rms(xv, eps);
        loadv(cos + table, c);
        loadv(ssin + table, s);
        loadv(dy + b * db + l * dl + h * dh + lane * V, d);
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < V; i++) {
            g[i] = d[i] * c[i] + __shfl_xor_sync(0xffffffffu, d[i] * s[i], 16);
            const float xn = xv[i] * r;
            acc[i] += g[i] * xn;
            g[i] *= wv[i];  // now d(xn)
            dot += g[i] * xn;
        }
        dot = warp_sum(dot) / D;
#pragma unroll
        for (int i = 0; i < V; i++) g[i] = r * (g[i] - xv[i] * r * dot);
        storev(dx + at, g);
    }
#pragma unroll
    for (int i = 0; i < V; i++) red[warp][lane * V + i] = acc[i];
    __syncthreads();
    for (int e = threadIdx.x; e < D; e += 32 * WARPS) {
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < WARPS; k++) sum += red[k][e];
        dw_part[(long long)blockIdx.x * D + e] = sum;
    }
}
