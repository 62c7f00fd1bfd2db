// The block part of split block attention on tensor cores: the kernels of block_part.cu (same
// parameters, same results) for blocks of 16 and head dims 64 or 128, where a block's 16 x 16
// scores are one m16n8k16 tile pair. A warp does a (block, query head) in registers, with no
// shared memory and no barriers in the forward and one in the backward; the SIMT kernels wait on
// a chain of shared-memory phases.
//
// Layouts (the PTX ISA's m16n8k16 fragments; lane = 4 g + c):
// - S = Q K^T sums over d in any order, so lane c loads 8 consecutive d (16 bytes) of Q's rows
//   g, g+8 and of K's rows: d = 32 kc + 8 c + 0..7 feed the k-slots 2c, 2c+1, 2c+8, 2c+9 of two
//   k-steps (.x, .y the first, .z, .w the second), the same for both operands.
// - P V (and dS K, dS^T Q, P^T dO) take the 16 block rows as the k-dim; their n-dim is d, mapped
//   so that n-tile nt's column g is d = g NO + nt: lane g loads NO consecutive d of 4 rows, and
//   lane c's accumulators hold d = 2c NO .. 2c NO + 2 NO of its rows (stored 16 bytes at a time).
//   The backward's dk and dv do the same within slices of D/4: d = slice DS + g NS + nt.
//
// Compiled at run time by NVRTC (kernels/src/nvrtc.rs), after block_part_spans.cuh and mma.cuh, with -DD=..
// -DG=..; rows 16-byte aligned (kernels/src/block_part.rs checks).

#define BK 16
#define WARPS 4      // the forward's query heads a CTA
#define NQ (D / 32)  // 16-byte chunks of a row a lane loads for S = Q K^T
#define NO (D / 8)   // n-tiles of P V (and dS K); d a lane g loads of a row
#define DS (D / 4)   // the backward's slices of d for dk, dv
#define NS (DS / 8)  // their n-tiles; d a lane g loads of a row

// The transpose of an 8 x 8 bf16 tile held as accumulator pairs (row g, columns 2c, 2c+1).
__device__ __forceinline__ u32 trans(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

__device__ __forceinline__ uint4 ld16(const bf16* p) { return *reinterpret_cast<const uint4*>(p); }

// N words (2N bf16) from p: 16 bytes at a time, then 8, then 4 (p aligned to match).
template <int N>
__device__ __forceinline__ void ld_words(u32* w, const bf16* p) {
    constexpr int N4 = N / 4 * 4;
#pragma unroll
    for (int i = 0; i < N4; i += 4) {
        const uint4 t = ld16(p + 2 * i);
        w[i] = t.x, w[i + 1] = t.y, w[i + 2] = t.z, w[i + 3] = t.w;
    }
    if constexpr (N % 4 >= 2) {
        const uint2 t = *reinterpret_cast<const uint2*>(p + 2 * N4);
        w[N4] = t.x, w[N4 + 1] = t.y;
    }
    if constexpr (N % 2) w[N - 1] = *reinterpret_cast<const u32*>(p + 2 * (N - 1));
}

template <int N>
__device__ __forceinline__ void st_words(bf16* p, const u32* w) {
    constexpr int N4 = N / 4 * 4;
#pragma unroll
    for (int i = 0; i < N4; i += 4) *reinterpret_cast<uint4*>(p + 2 * i) = make_uint4(w[i], w[i + 1], w[i + 2], w[i + 3]);
    if constexpr (N % 4 >= 2) *reinterpret_cast<uint2*>(p + 2 * N4) = make_uint2(w[N4], w[N4 + 1]);
    if constexpr (N % 2) *reinterpret_cast<u32*>(p + 2 * (N - 1)) = w[N - 1];
}

// The B fragment (k-slots 2c, 2c+1 | 2c+8, 2c+9; column g) of n-tile nt from the words of rows
// 2c, 2c+1, 2c+8, 2c+9 (r[0..3]) that lane g loaded: element nt of each.
__device__ __forceinline__ void b_frag(const u32* r0, const u32* r1, const u32* r2, const u32* r3, int nt, u32& b0, u32& b1) {
    const u32 sel = (nt & 1) ? 0x7632 : 0x5410;
    b0 = __byte_perm(r0[nt / 2], r1[nt / 2], sel);
    b1 = __byte_perm(r2[nt / 2], r3[nt / 2], sel);
}

// acc[nt] += A B for the N n-tiles of B: A the 16 x 16 fragment a0..a3, B's rows 2c, 2c+1, 2c+8,
// 2c+9 in r[0..3] as the lane loaded them (N / 2 words each).
template <int N>
__device__ __forceinline__ void mma_rows(float (*acc)[4], u32 a0, u32 a1, u32 a2, u32 a3, const u32 (*r)[N / 2]) {
#pragma unroll
    for (int nt = 0; nt < N; nt++) {
        u32 b0, b1;
        b_frag(r[0], r[1], r[2], r[3], nt, b0, b1);
        mma(acc[nt], a0, a1, a2, a3, b0, b1);
    }
}

// Element e (of 2N) of the lane's d range in row g + 8 rr, from the accumulators of N n-tiles
// whose column g is d = g N + nt: column 2c of n-tile e, or column 2c+1 of n-tile e - N.
template <int N>
__device__ __forceinline__ float acc_at(const float (*acc)[4], int e, int rr) {
    return e < N ? acc[e][2 * rr] : acc[e - N][2 * rr + 1];
}

// 8 bf16 products summed: a . b
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    return lo(a.x) * lo(b.x) + hi(a.x) * hi(b.x) + lo(a.y) * lo(b.y) + hi(a.y) * hi(b.y) + lo(a.z) * lo(b.z) +
           hi(a.z) * hi(b.z) + lo(a.w) * lo(b.w) + hi(a.w) * hi(b.w);
}

// acc (16 x 8 n-tiles) += the rows g, g+8 of A (16 x 32 chunk kc of d) times B^T's rows.
#define QK_CHUNK(acc, a0, a1, b0, b1)                          \
    mma(acc[0], a0.x, a1.x, a0.y, a1.y, b0.x, b0.y);           \
    mma(acc[0], a0.z, a1.z, a0.w, a1.w, b0.z, b0.w);           \
    mma(acc[1], a0.x, a1.x, a0.y, a1.y, b1.x, b1.y);           \
    mma(acc[1], a0.z, a1.z, a0.w, a1.w, b1.z, b1.w);

// Forward, as block_part.cu's. A warp a (block, query head), WARPS query heads a CTA.
extern "C" __global__ void __launch_bounds__(WARPS * 32) block_part_forward(
    const bf16* __restrict__ q, long long qb, long long qh, long long qn,
    const bf16* __restrict__ k, long long kb, long long kh, long long kn,
    const bf16* __restrict__ v, long long vb, long long vh, long long vn,
    const Parts parts, const long long* __restrict__ anchors,
    bf16* __restrict__ out, long long ob, long long oh, long long on,
    float* __restrict__ lse, int nh, int n, int s, int window, float scale) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int a = blockIdx.x, h = blockIdx.y * WARPS + (threadIdx.x >> 5), b = blockIdx.z;
    if (h >= nh) return;
    const int kvh = h / G;
    const long long row0 = (long long)a * BK;

    // The context spans of this block (none: it sees no context).
    const BlockSpans spans = block_spans(parts, row0, b, h, nh);
    const bool has_context = anchors[(long long)b * gridDim.x + a] > 0;
    float lc[MAX_SPANS][2];
#pragma unroll
    for (int p = 0; p < MAX_SPANS; p++)
#pragma unroll
        for (int rr = 0; rr < 2; rr++) lc[p][rr] = p < spans.n ? spans.lse[p][g + 8 * rr] : __int_as_float(0xff800000);

    // S = Q K^T: rows g, g+8; n-tile nt's column g is block key 8 nt + g.
    const bf16* qp = q + b * qb + h * qh + (row0 + g) * qn + 8 * c;
    const bf16* kp = k + b * kb + kvh * kh + (s + row0 + g) * kn + 8 * c;
    float sc[2][4] = {};
#pragma unroll
    for (int kc = 0; kc < NQ; kc++) {
        const uint4 q0 = ld16(qp + 32 * kc), q1 = ld16(qp + 8 * qn + 32 * kc);
        const uint4 k0 = ld16(kp + 32 * kc), k1 = ld16(kp + 8 * kn + 32 * kc);
        QK_CHUNK(sc, q0, q1, k0, k1)
    }
    // V for P V: rows 2c, 2c+1, 2c+8, 2c+9, d = g NO .. g NO + NO.
    u32 vr[4][NO / 2];
    const bf16* vp = v + b * vb + kvh * vh + (s + row0) * vn + g * NO;
#pragma unroll
    for (int r = 0; r < 4; r++) ld_words<NO / 2>(vr[r], vp + (2 * c + (r & 1) + 8 * (r >> 1)) * vn);

    // Softmax of each row over its block keys (accumulator e of n-tile nt: row g + 8 (e / 2),
    // key 8 nt + 2c + e % 2), merged with the context part's through the log-sum-exps.
    float l[2], w[MAX_SPANS][2];
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        const int i = g + 8 * rr;
        float m = __int_as_float(0xff800000);
#pragma unroll
        for (int nt = 0; nt < 2; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float& x = sc[nt][2 * rr + e];
                x = (window > 0 && 8 * nt + 2 * c + e > i) ? __int_as_float(0xff800000) : x * scale;
                m = fmaxf(m, x);
            }
        m = quad_max(m);  // finite: key 0 is seen by every row
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < 2; nt++) sum += expf(sc[nt][2 * rr] - m) + expf(sc[nt][2 * rr + 1] - m);
        const float lb = m + logf(quad_sum(sum));
        const bool sees = has_context && (window == 0 || i < window - 1);
        float mx = lb;
#pragma unroll
        for (int p = 0; p < MAX_SPANS; p++) {
            if (!sees) lc[p][rr] = __int_as_float(0xff800000);
            mx = fmaxf(mx, lc[p][rr]);
        }
        float sum_all = expf(lb - mx);
#pragma unroll
        for (int p = 0; p < MAX_SPANS; p++) sum_all += expf(lc[p][rr] - mx);
        l[rr] = mx + logf(sum_all);
#pragma unroll
        for (int p = 0; p < MAX_SPANS; p++) w[p][rr] = expf(lc[p][rr] - l[rr]);
#pragma unroll
        for (int nt = 0; nt < 2; nt++) {
            sc[nt][2 * rr] = expf(sc[nt][2 * rr] - l[rr]);
            sc[nt][2 * rr + 1] = expf(sc[nt][2 * rr + 1] - l[rr]);
        }
    }
    // O = P V, P as the A fragment straight from the accumulators.
    const u32 p0 = pack(sc[0][0], sc[0][1]), p1 = pack(sc[0][2], sc[0][3]), p2 = pack(sc[1][0], sc[1][1]), p3 = pack(sc[1][2], sc[1][3]);
    float acc[NO][4] = {};
    mma_rows<NO>(acc, p0, p1, p2, p3, vr);
    // Plus the context spans' outputs weighed in (where a row sees them: a row that sees none
    // may hold anything there); rows g, g+8 at d = 2c NO .. 2c NO + 2 NO.
    bf16* op = out + b * ob + h * oh + (row0 + g) * on + 2 * c * NO;
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        float x[2 * NO];
#pragma unroll
        for (int e = 0; e < 2 * NO; e++) x[e] = acc_at<NO>(acc, e, rr);
#pragma unroll
        for (int p = 0; p < MAX_SPANS; p++) {
            if (w[p][rr] > 0.f) {
                u32 ctx[NO];
                ld_words<NO>(ctx, spans.o[p] + (g + 8 * rr) * spans.on[p] + 2 * c * NO);
#pragma unroll
                for (int e = 0; e < NO; e++) {
                    x[2 * e] += w[p][rr] * lo(ctx[e]);
                    x[2 * e + 1] += w[p][rr] * hi(ctx[e]);
                }
            }
        }
        u32 y[NO];
#pragma unroll
        for (int e = 0; e < NO; e++) y[e] = pack(x[2 * e], x[2 * e + 1]);
        st_words<NO>(op + 8 * rr * on, y);
        if (c == 0) lse[((long long)b * nh + h) * n + row0 + g + 8 * rr] = l[rr];
    }
}

// Backward, as block_part.cu's: a CTA a (block, kv head) of G warps, in two phases.
// 1. Warp w takes query head kvh G + w: S, dP = dO V^T, P, dS = P (dP - D_i) scale, and the head's
//    dq; it leaves P^T and dS^T (as A fragments) in shared memory.
// 2. Warp w takes the d slices w, w + G, .. of dk = sum_h dS_h^T Q_h and dv = sum_h P_h^T dO_h (a
//    slice's n-tile nt column g is d = slice DS + g NS + nt).
// The G heads run side by side; one warp doing them in turn waits on memory G times as long.
extern "C" __global__ void __launch_bounds__(G * 32) block_part_backward(
    const bf16* __restrict__ q, long long qb, long long qh, long long qn,
    const bf16* __restrict__ k, long long kb, long long kh, long long kn,
    const bf16* __restrict__ v, long long vb, long long vh, long long vn,
    const bf16* __restrict__ d_out, long long db, long long dh, long long dn,
    const bf16* __restrict__ out, long long ob, long long oh, long long on,
    const float* __restrict__ lse,
    bf16* __restrict__ dq, long long gb, long long gh, long long gn,
    bf16* __restrict__ dk, bf16* __restrict__ dv, long long kgb, long long kgh, long long kgn,
    int nh, int n, int s, int window, float scale) {
    __shared__ u32 frag_pt[G][4][32], frag_dst[G][4][32];
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, w = threadIdx.x >> 5;
    const int a = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, h = kvh * G + w;
    const long long row0 = (long long)a * BK;
    const bf16* kbase = k + b * kb + kvh * kh + (s + row0) * kn;
    const bf16* vbase = v + b * vb + kvh * vh + (s + row0) * vn;

    // 1. S = Q K^T, dP = dO V^T, and D_i = rowsum(dO * O) (rows g, g+8).
    {
        const bf16* qp = q + b * qb + h * qh + (row0 + g) * qn + 8 * c;
        const bf16* dop = d_out + b * db + h * dh + (row0 + g) * dn + 8 * c;
        const bf16* opp = out + b * ob + h * oh + (row0 + g) * on + 8 * c;
        const bf16* kp = kbase + g * kn + 8 * c;
        const bf16* vp = vbase + g * vn + 8 * c;
        float sc[2][4] = {}, dp[2][4] = {}, dsum[2] = {0.f, 0.f};
#pragma unroll
        for (int kc = 0; kc < NQ; kc++) {
            const uint4 q0 = ld16(qp + 32 * kc), q1 = ld16(qp + 8 * qn + 32 * kc);
            const uint4 g0 = ld16(dop + 32 * kc), g1 = ld16(dop + 8 * dn + 32 * kc);
            const uint4 o0 = ld16(opp + 32 * kc), o1 = ld16(opp + 8 * on + 32 * kc);
            const uint4 k0 = ld16(kp + 32 * kc), k1 = ld16(kp + 8 * kn + 32 * kc);
            const uint4 v0 = ld16(vp + 32 * kc), v1 = ld16(vp + 8 * vn + 32 * kc);
            QK_CHUNK(sc, q0, q1, k0, k1)
            QK_CHUNK(dp, g0, g1, v0, v1)
            dsum[0] += dot8(g0, o0);
            dsum[1] += dot8(g1, o1);
        }
        // K's rows 2c, 2c+1, 2c+8, 2c+9 at d = g NO .. g NO + NO, for dq = dS K.
        u32 kt[4][NO / 2];
#pragma unroll
        for (int r = 0; r < 4; r++) ld_words<NO / 2>(kt[r], kbase + (2 * c + (r & 1) + 8 * (r >> 1)) * kn + g * NO);
        // P from the merged log-sum-exp; dS = P (dP - D_i) scale.
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            const int i = g + 8 * rr;
            const float l = lse[((long long)b * nh + h) * n + row0 + i], d_i = quad_sum(dsum[rr]);
#pragma unroll
            for (int nt = 0; nt < 2; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int x = 2 * rr + e;
                    const float p = (window > 0 && 8 * nt + 2 * c + e > i) ? 0.f : expf(sc[nt][x] * scale - l);
                    sc[nt][x] = p;
                    dp[nt][x] = p * (dp[nt][x] - d_i) * scale;
                }
        }
        // As A fragments (rows i, k-slots keys j) and transposed (rows j, k-slots i): tile (r, t)
        // of the 16 x 16 is the pair of accumulators 2r, 2r+1 of n-tile t.
        const u32 ds0 = pack(dp[0][0], dp[0][1]), ds1 = pack(dp[0][2], dp[0][3]), ds2 = pack(dp[1][0], dp[1][1]), ds3 = pack(dp[1][2], dp[1][3]);
        frag_pt[w][0][lane] = trans(pack(sc[0][0], sc[0][1]));
        frag_pt[w][1][lane] = trans(pack(sc[1][0], sc[1][1]));
        frag_pt[w][2][lane] = trans(pack(sc[0][2], sc[0][3]));
        frag_pt[w][3][lane] = trans(pack(sc[1][2], sc[1][3]));
        frag_dst[w][0][lane] = trans(ds0);
        frag_dst[w][1][lane] = trans(ds2);
        frag_dst[w][2][lane] = trans(ds1);
        frag_dst[w][3][lane] = trans(ds3);
        // dq += dS K: rows g, g+8 at d = 2c NO .. 2c NO + 2 NO, on the context part's gradient.
        float acc[NO][4] = {};
        mma_rows<NO>(acc, ds0, ds1, ds2, ds3, kt);
        bf16* dqp = dq + b * gb + h * gh + (row0 + g) * gn + 2 * c * NO;
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            u32 old[NO], y[NO];
            ld_words<NO>(old, dqp + 8 * rr * gn);
#pragma unroll
            for (int e = 0; e < NO; e++) y[e] = pack(lo(old[e]) + acc_at<NO>(acc, 2 * e, rr), hi(old[e]) + acc_at<NO>(acc, 2 * e + 1, rr));
            st_words<NO>(dqp + 8 * rr * gn, y);
        }
    }
    __syncthreads();

    // 2. dk, dv slice by slice, summed over the heads.
    for (int slice = w; slice < D / DS; slice += G) {
        const int ws = slice * DS;
        float acc_k[NS][4] = {}, acc_v[NS][4] = {};
#pragma unroll
        for (int hh = 0; hh < G; hh++) {
            // Q's and dO's rows 2c, 2c+1, 2c+8, 2c+9 of head hh at d = ws + g NS .. + NS.
            u32 qt[4][NS / 2], dot[4][NS / 2];
            const bf16* qs = q + b * qb + (kvh * G + hh) * qh + row0 * qn + ws + g * NS;
            const bf16* dos = d_out + b * db + (kvh * G + hh) * dh + row0 * dn + ws + g * NS;
#pragma unroll
            for (int r = 0; r < 4; r++) {
                const int i = 2 * c + (r & 1) + 8 * (r >> 1);
                ld_words<NS / 2>(qt[r], qs + i * qn);
                ld_words<NS / 2>(dot[r], dos + i * dn);
            }
            const u32* pt = &frag_pt[hh][0][lane];
            const u32* dst = &frag_dst[hh][0][lane];
#pragma unroll
            for (int nt = 0; nt < NS; nt++) {
                u32 b0, b1;
                b_frag(qt[0], qt[1], qt[2], qt[3], nt, b0, b1);
                mma(acc_k[nt], dst[0], dst[32], dst[64], dst[96], b0, b1);
                b_frag(dot[0], dot[1], dot[2], dot[3], nt, b0, b1);
                mma(acc_v[nt], pt[0], pt[32], pt[64], pt[96], b0, b1);
            }
        }
        // The block keys' rows g, g+8 of dk and dv at d = ws + 2c NS .. + 2 NS.
        const long long at = b * kgb + kvh * kgh + (s + row0 + g) * kgn + ws + 2 * c * NS;
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            u32 yk[NS], yv[NS];
#pragma unroll
            for (int e = 0; e < NS; e++) {
                yk[e] = pack(acc_at<NS>(acc_k, 2 * e, rr), acc_at<NS>(acc_k, 2 * e + 1, rr));
                yv[e] = pack(acc_at<NS>(acc_v, 2 * e, rr), acc_at<NS>(acc_v, 2 * e + 1, rr));
            }
            st_words<NS>(dk + at + 8 * rr * kgn, yk);
            st_words<NS>(dv + at + 8 * rr * kgn, yv);
        }
    }
}
