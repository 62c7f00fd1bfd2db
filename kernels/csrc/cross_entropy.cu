// Cross-entropy over fp32 logit rows (host/src/loss.rs), in two passes over the logits instead of
// libtorch's five (log-softmax's three, exp, argmax): `ce_row_stats` reads a row once for its
// log-sum-exp, the label's log-probability and whether the argmax is the label;
// `ce_softmax_grad` reads it again and writes softmax - onehot in bf16 (the label's entry as
// expm1 of its log-probability, from fp32: p - 1 near 1 would round away).
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

// One more element, with one exp (the merge above takes two).
__device__ __forceinline__ Stat push(Stat a, float x, int i) {
    if (a.s == 0.f) {
        a.m = x;
        a.s = 1.f;
        a.i = i;
    } else if (x > a.m) {  // strictly: the first index of the max stays
        a.s = a.s * expf(a.m - x) + 1.f;
        a.m = x;
        a.i = i;
    } else {
        a.s += expf(x - a.m);
    }
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
    // UNROLL loads in flight a thread (the pushes are a serial chain); the same order as one at
    // a time.
    for (int v0 = threadIdx.x * 4; v0 < V; v0 += STATS_THREADS * 4 * UNROLL) {
        float4 x[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int v = v0 + u * STATS_THREADS * 4;
            if (v < V) x[u] = *reinterpret_cast<const float4*>(row + v);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int v = v0 + u * STATS_THREADS * 4;
            if (v >= V) break;
            st = push(st, x[u].x, v);
            st = push(st, x[u].y, v + 1);
            st = push(st, x[u].z, v + 2);
            st = push(st, x[u].w, v + 3);
        }
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

// softmax - onehot in bf16: grid (ceil(V / (4 * GRAD_GROUPS) / threads), rows); a thread takes
// GRAD_GROUPS groups of 4, a block apart, all loads first.
extern "C" __global__ void ce_softmax_grad(
    const float* z, long long ld, int V, const long long* labels, const float* lse, bf16* out, long long ldo) {
    const long long r = blockIdx.y;
    const int v0 = blockIdx.x * blockDim.x * 4 * GRAD_GROUPS + threadIdx.x * 4;
    const float l = lse[r];
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
        *reinterpret_cast<uint2*>(out + r * ldo + v) =
            make_uint2(bf16_bits(p[0]) | (bf16_bits(p[1]) << 16), bf16_bits(p[2]) | (bf16_bits(p[3]) << 16));
    }
}
