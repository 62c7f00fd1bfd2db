// The block part of split block attention (kernels/src/block_attention.rs), fused: one CTA per
// (block, query head, sequence) scores the head's BK rows against the block's own BK keys and
// merges them with the context part through the log-sum-exps; backward, one CTA per (block, kv
// head, sequence) takes the G query heads in turn, adds to dq in place and writes the block keys'
// dk, dv. The composite it replaces is a dozen passes of small batched
// matmuls, casts and layout copies; this reads each input once.
//
// Compiled at run time by NVRTC (kernels/src/nvrtc.rs), after block_part_spans.cuh, with
// -DBK=.. -DD=.. -DG=..; bf16 in and out, fp32 inside. Tensors come as base pointers and element
// strides: the last dim dense, rows 8-byte aligned (kernels/src/block_part.rs checks), so each
// thread moves 4 elements at a time.
// A row of D elements is D/4 consecutive threads (a power of two up to a warp).
//
// `window` > 0: a sliding-window layer (HF's sliding_window, any length from 1), causal: row i
// sees its block's keys 0..=i only, and the context only when its window reaches back past the
// anchor (i < window - 1; the context part's bias cut the rest).

#define THREADS 128
#define DP (D + 4)        // shared rows padded by 4 words: consecutive rows start 4 banks apart
#define ROW (D / 4)       // threads a row
#define HALF (BK / 2)     // a pair work item scores key j and j + HALF
#define QUADS (BK * D / 4 / THREADS)  // 4-element groups of a BK x D slab, per thread

__device__ __forceinline__ float4 widen(uint2 u) {  // 4 bf16 -> fp32
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
}

__device__ __forceinline__ uint2 load_raw(const bf16* p) { return *reinterpret_cast<const uint2*>(p); }

__device__ __forceinline__ float4 load4(const bf16* p) { return widen(load_raw(p)); }

__device__ __forceinline__ unsigned bf16_bits(float x) {  // round to nearest even, NaN kept
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ void store4(bf16* p, float4 x) {
    *reinterpret_cast<uint2*>(p) = make_uint2(bf16_bits(x.x) | (bf16_bits(x.y) << 16), bf16_bits(x.z) | (bf16_bits(x.w) << 16));
}

__device__ __forceinline__ void fma4(float4& acc, float a, float4 b) {
    acc.x += a * b.x; acc.y += a * b.y; acc.z += a * b.z; acc.w += a * b.w;
}

__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

__device__ __forceinline__ float4& at4(float (*s)[DP], int r, int d) { return *reinterpret_cast<float4*>(&s[r][d]); }

// Element (r, d) of a BK x D slab for the q-th 4-group of this thread.
#define SLAB_R(q) ((threadIdx.x + (q) * THREADS) / ROW)
#define SLAB_D(q) (((threadIdx.x + (q) * THREADS) % ROW) * 4)

// Rows of a [rows, D] slab at `base` (row stride `rs`) into shared fp32.
__device__ __forceinline__ void load_rows(float (*dst)[DP], const bf16* base, long long rs) {
#pragma unroll
    for (int q = 0; q < QUADS; q++) at4(dst, SLAB_R(q), SLAB_D(q)) = load4(base + SLAB_R(q) * rs + SLAB_D(q));
}

// Sum over the ROW threads of a row (aligned groups of lanes).
__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int off = ROW / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

// Forward. q [B, nh, N, D]; k, v [B, nkv, S + N, D] (the block keys from S); `parts` the context
// part's outputs and log-sum-exps; anchors [B, A] (int64, dense): a block at anchor 0 (or,
// windowed, a row past window - 2) sees no context and its context part is ignored. Writes out
// [B, nh, N, D] (any strides) and the merged lse [B, nh, N] (fp32, dense). One CTA a (block,
// query head, sequence): the G heads of a kv head in CTAs of their own rather than one after
// another (the kernel waits on memory, not math).
extern "C" __global__ void __launch_bounds__(THREADS) block_part_forward(
    const bf16* q, long long qb, long long qh, long long qn,
    const bf16* k, long long kb, long long kh, long long kn,
    const bf16* v, long long vb, long long vh, long long vn,
    const Parts parts, const long long* anchors,
    bf16* out, long long ob, long long oh, long long on,
    float* lse, int nh, int n, int s, int window, float scale) {
    const int a = blockIdx.x, h = blockIdx.y, kvh = h / G, b = blockIdx.z, t = threadIdx.x;
    __shared__ __align__(16) float sk[BK][DP], sv[BK][DP], sq[BK][DP];
    __shared__ float sp[BK][BK + 1], sw[BK][MAX_SPANS];
    const long long row0 = (long long)a * BK;
    load_rows(sk, k + b * kb + kvh * kh + (s + row0) * kn, kn);
    load_rows(sv, v + b * vb + kvh * vh + (s + row0) * vn, vn);
    load_rows(sq, q + b * qb + h * qh + row0 * qn, qn);
    // The context spans of this block (none: it sees no context), and their outputs for the
    // merge, loaded now so their latency hides behind the scores (used only where their weight
    // is > 0).
    const BlockSpans spans = block_spans(parts, row0, b, h, nh);
    // Read now, used after the scores: the loads above do not wait for it.
    const bool has_context = anchors[(long long)b * gridDim.x + a] > 0;
    float4 from_ctx[MAX_SPANS][QUADS];
#pragma unroll
    for (int p = 0; p < MAX_SPANS; p++) {
#pragma unroll
        for (int qd = 0; qd < QUADS; qd++) {
            const int i = SLAB_R(qd), d = SLAB_D(qd);
            from_ctx[p][qd] = p < spans.n ? load4(spans.o[p] + i * spans.on[p] + d) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    }
    __syncthreads();
    for (int p = t; p < BK * HALF; p += THREADS) {  // scores of (i, j) and (i, j + HALF)
        const int i = p / HALF, j = p % HALF;
        float s0 = 0.f, s1 = 0.f;
#pragma unroll 8
        for (int d = 0; d < D; d += 4) {
            const float4 x = at4(sq, i, d);
            s0 += dot4(x, at4(sk, j, d));
            s1 += dot4(x, at4(sk, j + HALF, d));
        }
        sp[i][j] = s0 * scale;
        sp[i][j + HALF] = s1 * scale;
    }
    __syncthreads();
    if (t < BK) {  // row t: the block's softmax merged with the context's
        const long long idx = ((long long)b * nh + h) * n + row0 + t;
        const int last = window > 0 ? t : BK - 1;  // the last block key row t sees
        float m = __int_as_float(0xff800000);  // -inf
        for (int j = 0; j <= last; j++) m = fmaxf(m, sp[t][j]);
        float sum = 0.f;
        for (int j = 0; j <= last; j++) sum += expf(sp[t][j] - m);
        const float lb = m + logf(sum);
        float l = lb, lc[MAX_SPANS];
        const bool sees = has_context && (window == 0 || t < window - 1);
#pragma unroll
        for (int p = 0; p < MAX_SPANS; p++) {
            lc[p] = sees && p < spans.n ? spans.lse[p][t] : __int_as_float(0xff800000);
        }
        float mx = lb;
        for (int p = 0; p < MAX_SPANS; p++) mx = fmaxf(mx, lc[p]);
        float sum_all = expf(lb - mx);
        for (int p = 0; p < MAX_SPANS; p++) sum_all += expf(lc[p] - mx);
        l = mx + logf(sum_all);
        lse[idx] = l;
        for (int p = 0; p < MAX_SPANS; p++) sw[t][p] = expf(lc[p] - l);
        for (int j = 0; j < BK; j++) sp[t][j] = j <= last ? expf(sp[t][j] - l) : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int qd = 0; qd < QUADS; qd++) {
        const int i = SLAB_R(qd), d = SLAB_D(qd);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int j = 0; j < BK; j++) fma4(acc, sp[i][j], at4(sv, j, d));
#pragma unroll
        for (int p = 0; p < MAX_SPANS; p++)
            if (sw[i][p] > 0.f) fma4(acc, sw[i][p], from_ctx[p][qd]);
        store4(out + b * ob + h * oh + (row0 + i) * on + d, acc);
    }
}

// Backward. P from the merged lse, D_i = rowsum(dO * O) over the full row, dS = P (dP - D) scale.
// dq [B, nh, N, D] holds the context part's gradient and gets the block part's added (in fp32,
// rounded once); dk, dv [B, nkv, S + N, D] get the block keys' rows (summed over the G heads).
extern "C" __global__ void __launch_bounds__(THREADS) block_part_backward(
    const bf16* q, long long qb, long long qh, long long qn,
    const bf16* k, long long kb, long long kh, long long kn,
    const bf16* v, long long vb, long long vh, long long vn,
    const bf16* d_out, long long db, long long dh, long long dn,
    const bf16* out, long long ob, long long oh, long long on,
    const float* lse,
    bf16* dq, long long gb, long long gh, long long gn,
    bf16* dk, bf16* dv, long long kgb, long long kgh, long long kgn,
    int nh, int n, int s, int window, float scale) {
    const int a = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, t = threadIdx.x;
    __shared__ __align__(16) float sk[BK][DP], sv[BK][DP], sq[BK][DP], sdo[BK][DP];
    __shared__ float sp[BK][BK + 1], sds[BK][BK + 1], srow[BK];
    const long long row0 = (long long)a * BK;
    load_rows(sk, k + b * kb + kvh * kh + (s + row0) * kn, kn);
    load_rows(sv, v + b * vb + kvh * vh + (s + row0) * vn, vn);
    float4 acc_k[QUADS], acc_v[QUADS];
#pragma unroll
    for (int qd = 0; qd < QUADS; qd++) acc_k[qd] = acc_v[qd] = make_float4(0.f, 0.f, 0.f, 0.f);

    // A head's q, dO, O and dq rows, fetched (as raw bf16) one head ahead: their latency hides
    // behind the previous head's math.
    uint2 next_q[QUADS], next_do[QUADS], next_o[QUADS], next_dq[QUADS];
#define FETCH(head)                                                                 \
    for (int qd = 0; qd < QUADS; qd++) {                                            \
        const long long i = row0 + SLAB_R(qd), d = SLAB_D(qd);                      \
        next_q[qd] = load_raw(q + b * qb + (head) * qh + i * qn + d);               \
        next_do[qd] = load_raw(d_out + b * db + (head) * dh + i * dn + d);          \
        next_o[qd] = load_raw(out + b * ob + (head) * oh + i * on + d);             \
        next_dq[qd] = load_raw(dq + b * gb + (head) * gh + i * gn + d);             \
    }
#pragma unroll
    FETCH(kvh * G)

    for (int gi = 0; gi < G; gi++) {
        const int h = kvh * G + gi;
        float4 old_dq[QUADS];
#pragma unroll
        for (int qd = 0; qd < QUADS; qd++) {  // q, dO into shared, and D_i = rowsum(dO * O)
            const int i = SLAB_R(qd), d = SLAB_D(qd);
            at4(sq, i, d) = widen(next_q[qd]);
            const float4 g = widen(next_do[qd]);
            at4(sdo, i, d) = g;
            old_dq[qd] = widen(next_dq[qd]);
            const float part = row_sum(dot4(g, widen(next_o[qd])));
            if (d == 0) srow[i] = part;
        }
        __syncthreads();
        if (gi + 1 < G) {
#pragma unroll
            FETCH(h + 1)
        }
        for (int p = t; p < BK * HALF; p += THREADS) {
            const int i = p / HALF, j = p % HALF;
            float s0 = 0.f, s1 = 0.f, g0 = 0.f, g1 = 0.f;
#pragma unroll 4
            for (int d = 0; d < D; d += 4) {
                const float4 x = at4(sq, i, d), y = at4(sdo, i, d);
                s0 += dot4(x, at4(sk, j, d));
                s1 += dot4(x, at4(sk, j + HALF, d));
                g0 += dot4(y, at4(sv, j, d));
                g1 += dot4(y, at4(sv, j + HALF, d));
            }
            const float l = lse[((long long)b * nh + h) * n + row0 + i];
            // Windowed: P is 0 past the row's own position (key j > row i).
            const float p0 = (window > 0 && j > i) ? 0.f : expf(s0 * scale - l);
            const float p1 = (window > 0 && j + HALF > i) ? 0.f : expf(s1 * scale - l);
            sp[i][j] = p0;
            sp[i][j + HALF] = p1;
            sds[i][j] = p0 * (g0 - srow[i]) * scale;
            sds[i][j + HALF] = p1 * (g1 - srow[i]) * scale;
        }
        __syncthreads();
#pragma unroll
        for (int qd = 0; qd < QUADS; qd++) {
            const int r = SLAB_R(qd), d = SLAB_D(qd);
            float4 g = make_float4(0.f, 0.f, 0.f, 0.f);  // dq row r += dS K
#pragma unroll
            for (int j = 0; j < BK; j++) fma4(g, sds[r][j], at4(sk, j, d));
            const float4 old = old_dq[qd];
            store4(dq + b * gb + h * gh + (row0 + r) * gn + d, make_float4(old.x + g.x, old.y + g.y, old.z + g.z, old.w + g.w));
#pragma unroll
            for (int i = 0; i < BK; i++) {  // key row r: dk += dS^T Q, dv += P^T dO
                fma4(acc_k[qd], sds[i][r], at4(sq, i, d));
                fma4(acc_v[qd], sp[i][r], at4(sdo, i, d));
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int qd = 0; qd < QUADS; qd++) {
        const int j = SLAB_R(qd), d = SLAB_D(qd);
        const long long at = b * kgb + kvh * kgh + (s + row0 + j) * kgn + d;
        store4(dk + at, acc_k[qd]);
        store4(dv + at, acc_v[qd]);
    }
#undef FETCH
}
