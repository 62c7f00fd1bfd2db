// Cross-entropy over fp32 logit rows (host/src/loss.rs), in two passes over the logits instead of
// libtorch's five (log-softmax's three, exp, argmax): `ce_row_stats` reads a row once for its
// log-sum-exp, the label's log-probability and whether the argmax is the label;
// `ce_softmax_grad` reads it again and writes (softmax - onehot) times the row's scale (its loss
// weight) in bf16 (the label's entry as expm1 of its log-probability, from fp32: p - 1 near 1
// would round away).
//
// Compiled at run time by NVRTC (kernels/src/nvrtc.rs). Rows have V elements, V a multiple of 4,
// row strides multiples of 4, so each thread reads 4 logits at a time.

typedef unsigned short bf16;

#define STATS_THREADS 512
#define UNROLL 4
#define GRAD_GROUPS 2

__device__ __forceinline__ unsigned bf16_bits(float x) {  // round to nearest even, NaN kept
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// Online (max, sum of exp(x - max), first index of the max), merged.
struct Stat {
    float m, s;
    int i;
};

__device__ __forceinline__ Stat merge(Stat a, Stat b) {
    if (b.s == 0.f) return a;  // empty
    if (a.s == 0.f) return b;
    const float m = fmaxf(a.m, b.m);
    Stat r;
    r.m = m;
    r.s = a.s * expf(a.m - m) + b.s * expf(b.m - m);
    r.i = a.m > b.m ? a.i : (b.m > a.m ? b.i : min(a.i, b.i));
    return r;
}

// N more elements x[0..N) at indices idx[0..N) (increasing; -inf for none): their max first,
// then their exps side by side (independent, where a push per element is a chain of them).
template <int N>
__device__ __forceinline__ Stat push_all(Stat a, const float* x, const int* idx) {
    float m = x[0];
#pragma unroll
    for (int k = 1; k < N; k++) m = fmaxf(m, x[k]);
    int i = idx[0];
#pragma unroll
    for (int k = N - 1; k >= 0; k--)
        if (x[k] == m) i = idx[k];  // the first index of the max
    const float mn = a.s == 0.f ? m : fmaxf(a.m, m);
    float s = a.s == 0.f ? 0.f : a.s * expf(a.m - mn);
#pragma unroll
    for (int k = 0; k < N; k++) s += expf(x[k] - mn);
    if (a.s == 0.f || m > a.m) a.i = i;  // strictly: the earlier index of an equal max stays
    a.m = mn;
    a.s = s;
    return a;
}

// One CTA a row: lse[r], logp_label[r] = z[label] - lse, hit[r] = (argmax == label).
extern "C" __global__ void __launch_bounds__(STATS_THREADS) ce_row_stats(
    const float* z, long long ld, int V, const long long* labels, float* lse, float* logp_label, unsigned char* hit) {
    const long long r = blockIdx.x;
    const float* row = z + r * ld;
    Stat st;
    st.m = 0.f;
    st.s = 0.f;
    st.i = 0x7fffffff;
    // UNROLL loads in flight a thread, then their 4 UNROLL logits pushed at once.
    for (int v0 = threadIdx.x * 4; v0 < V; v0 += STATS_THREADS * 4 * UNROLL) {
        float x[4 * UNROLL];
        int idx[4 * UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int v = v0 + u * STATS_THREADS * 4;
            const float none = __int_as_float(0xff800000);  // -inf: past the row
            float4 f = make_float4(none, none, none, none);
            if (v < V) f = *reinterpret_cast<const float4*>(row + v);
            x[4 * u] = f.x, x[4 * u + 1] = f.y, x[4 * u + 2] = f.z, x[4 * u + 3] = f.w;
#pragma unroll
            for (int e = 0; e < 4; e++) idx[4 * u + e] = v + e;
        }
        st = push_all<4 * UNROLL>(st, x, idx);
    }
    for (int off = 16; off > 0; off /= 2) {
        Stat o;
        o.m = __shfl_xor_sync(0xffffffffu, st.m, off);
        o.s = __shfl_xor_sync(0xffffffffu, st.s, off);
        o.i = __shfl_xor_sync(0xffffffffu, st.i, off);
        st = merge(st, o);
    }
    __shared__ Stat warps[STATS_THREADS / 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) warps[warp] = st;
    __syncthreads();
    if (threadIdx.x == 0) {
        Stat all = warps[0];
        for (int w = 1; w < STATS_THREADS / 32; w++) all = merge(all, warps[w]);
        const float l = all.m + logf(all.s);
        const long long label = labels[r];
        lse[r] = l;
        logp_label[r] = row[label] - l;
        hit[r] = all.i == label ? 1 : 0;
    }
}

// (softmax - onehot) * row_scale in bf16: grid (ceil(V / (4 * GRAD_GROUPS) / threads), rows); a thread takes
// GRAD_GROUPS groups of 4, a block apart, all loads first.
extern "C" __global__ void ce_softmax_grad(
    const float* z, long long ld, int V, const long long* labels, const float* lse, const float* row_scale, bf16* out,
    long long ldo) {
    const long long r = blockIdx.y;
    const int v0 = blockIdx.x * blockDim.x * 4 * GRAD_GROUPS + threadIdx.x * 4;
    const float l = lse[r], scale = row_scale[r];
    const long long label = labels[r];
    float4 x[GRAD_GROUPS];
#pragma unroll
    for (int u = 0; u < GRAD_GROUPS; u++) {
        const int v = v0 + u * blockDim.x * 4;
        if (v < V) x[u] = *reinterpret_cast<const float4*>(z + r * ld + v);
    }
#pragma unroll
    for (int u = 0; u < GRAD_GROUPS; u++) {
        const int v = v0 + u * blockDim.x * 4;
        if (v >= V) break;
        float p[4] = {expf(x[u].x - l), expf(x[u].y - l), expf(x[u].z - l), expf(x[u].w - l)};
        if (label >= v && label < v + 4) {
            const float xs[4] = {x[u].x, x[u].y, x[u].z, x[u].w};
            p[label - v] = expm1f(xs[label - v] - l);
        }
#pragma unroll
        for (int k = 0; k < 4; k++) p[k] *= scale;
        *reinterpret_cast<uint2*>(out + r * ldo + v) =
            make_uint2(bf16_bits(p[0]) | (bf16_bits(p[1]) << 16), bf16_bits(p[2]) | (bf16_bits(p[3]) << 16));
    }
}
