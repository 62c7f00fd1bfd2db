// Cross-entropy over logit rows (host/src/train/loss.rs), in two passes over the logits instead
// of libtorch's five (log-softmax's three, exp, argmax): `ce_row_stats_*` reads a row once for
// its log-sum-exp, the label's log-probability and whether the argmax is the label;
// `ce_softmax_grad_*` reads it again and writes (softmax - onehot) times the row's scale (its loss
// weight) in bf16 (the label's entry as expm1 of its log-probability, from fp32: p - 1 near 1
// would round away). Statistics are fp32 whatever the logits' type.
//
// One form per logit type: fp32 (4 logits a 16-byte load) and bf16 (8). bf16 logits are the
// model's own (HF's lm_head output): their gradient is written over them, each thread storing
// only the logits it has read.
//
// Compiled at run time by NVRTC (kernels/src/nvrtc.rs) behind csrc/bf16x8.cuh. Rows have V
// elements and row strides that are multiples of a load's logits, 16-byte aligned.

#define STATS_THREADS 512
#define UNROLL 4
#define GRAD_GROUPS 2

// E logits of one 16-byte load as fp32, and E bf16 values stored at once.
template <typename T>
struct Lanes;
template <>
struct Lanes<float> {
    static constexpr int E = 4;
    __device__ static void load(const float* p, float* x) {
        const float4 f = *reinterpret_cast<const float4*>(p);
        x[0] = f.x, x[1] = f.y, x[2] = f.z, x[3] = f.w;
    }
    __device__ static float one(const float* p) { return *p; }
};
template <>
struct Lanes<bf16> {
    static constexpr int E = 8;
    __device__ static void load(const bf16* p, float* x) { load8(p, x); }
    __device__ static float one(const bf16* p) { return bf16_float(*p); }
};

template <int E>
__device__ __forceinline__ void store_bf16(bf16* p, const float* x);
template <>
__device__ __forceinline__ void store_bf16<4>(bf16* p, const float* x) {
    *reinterpret_cast<uint2*>(p) =
        make_uint2(bf16_bits(x[0]) | (bf16_bits(x[1]) << 16), bf16_bits(x[2]) | (bf16_bits(x[3]) << 16));
}
template <>
__device__ __forceinline__ void store_bf16<8>(bf16* p, const float* x) { store8(p, x); }

// 2^x on the SFU (ex2.approx: ~2 ulp; 0 at -inf). expf's exact form costs a dozen instructions
// a logit and made both passes bound by arithmetic, not memory; the exponent's rounding in
// fma(x, log2 e, -m log2 e) adds ~|x - m| 6e-8 relative, far below the gradient's bf16.
#define LOG2E 1.4426950408889634f
__device__ __forceinline__ float exp2_sfu(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// exp(x - m) as 2^(x log2 e - m2), m2 = m log2 e.
__device__ __forceinline__ float exp_less(float x, float m2) { return exp2_sfu(fmaf(x, LOG2E, -m2)); }

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
    r.s = a.s * exp_less(a.m, m * LOG2E) + b.s * exp_less(b.m, m * LOG2E);
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
    const float mn = a.s == 0.f ? m : fmaxf(a.m, m), mn2 = mn * LOG2E;
    float s = a.s == 0.f ? 0.f : a.s * exp_less(a.m, mn2);
#pragma unroll
    for (int k = 0; k < N; k++) s += exp_less(x[k], mn2);
    if (a.s == 0.f || m > a.m) a.i = i;  // strictly: the earlier index of an equal max stays
    a.m = mn;
    a.s = s;
    return a;
}

// One CTA a row: lse[r], logp_label[r] = z[label] - lse, hit[r] = (argmax == label).
template <typename T>
__device__ __forceinline__ void row_stats(
    const T* z, long long ld, int V, const long long* labels, float* lse, float* logp_label, unsigned char* hit) {
    constexpr int E = Lanes<T>::E;
    const long long r = blockIdx.x;
    const T* row = z + r * ld;
    Stat st;
    st.m = 0.f;
    st.s = 0.f;
    st.i = 0x7fffffff;
    // UNROLL loads in flight a thread, then their E * UNROLL logits pushed at once.
    for (int v0 = threadIdx.x * E; v0 < V; v0 += STATS_THREADS * E * UNROLL) {
        float x[E * UNROLL];
        int idx[E * UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int v = v0 + u * STATS_THREADS * E;
            if (v < V) {
                Lanes<T>::load(row + v, x + E * u);
            } else {
#pragma unroll
                for (int e = 0; e < E; e++) x[E * u + e] = __int_as_float(0xff800000);  // -inf: past the row
            }
#pragma unroll
            for (int e = 0; e < E; e++) idx[E * u + e] = v + e;
        }
        st = push_all<E * UNROLL>(st, x, idx);
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
        logp_label[r] = Lanes<T>::one(row + label) - l;
        hit[r] = all.i == label ? 1 : 0;
    }
}

// (softmax - onehot) * row_scale in bf16: grid (ceil(V / (E * GRAD_GROUPS) / threads), rows); a
// thread takes GRAD_GROUPS groups of E, a block apart, all loads first (so `out` may be `z`).
template <typename T>
__device__ __forceinline__ void softmax_grad(
    const T* z, long long ld, int V, const long long* labels, const float* lse, const float* row_scale, bf16* out,
    long long ldo) {
    constexpr int E = Lanes<T>::E;
    const long long r = blockIdx.y;
    const int v0 = blockIdx.x * blockDim.x * E * GRAD_GROUPS + threadIdx.x * E;
    const float l = lse[r], l2 = l * LOG2E, scale = row_scale[r];
    const long long label = labels[r];
    float x[GRAD_GROUPS][E];
#pragma unroll
    for (int u = 0; u < GRAD_GROUPS; u++) {
        const int v = v0 + u * blockDim.x * E;
        if (v < V) Lanes<T>::load(z + r * ld + v, x[u]);
    }
#pragma unroll
    for (int u = 0; u < GRAD_GROUPS; u++) {
        const int v = v0 + u * blockDim.x * E;
        if (v >= V) break;
        float p[E];
#pragma unroll
        for (int k = 0; k < E; k++) p[k] = exp_less(x[u][k], l2);
        if (label >= v && label < v + E) {  // one thread of the row
#pragma unroll
            for (int k = 0; k < E; k++)
                if (v + k == label) p[k] = expm1f(x[u][k] - l);
        }
#pragma unroll
        for (int k = 0; k < E; k++) p[k] *= scale;
        store_bf16<E>(out + r * ldo + v, p);
    }
}

#define CE_KERNELS(NAME, T)                                                                                    \
    extern "C" __global__ void __launch_bounds__(STATS_THREADS) ce_row_stats_##NAME(                           \
        const T* z, long long ld, int V, const long long* labels, float* lse, float* logp_label,               \
        unsigned char* hit) {                                                                                  \
        row_stats<T>(z, ld, V, labels, lse, logp_label, hit);                                                  \
    }                                                                                                          \
    extern "C" __global__ void ce_softmax_grad_##NAME(                                                         \
        const T* z, long long ld, int V, const long long* labels, const float* lse, const float* row_scale,   \
        bf16* out, long long ldo) {                                                                            \
        softmax_grad<T>(z, ld, V, labels, lse, row_scale, out, ldo);                                           \
    }

CE_KERNELS(f32, float)
CE_KERNELS(bf16, bf16)
