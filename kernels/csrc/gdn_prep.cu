// The per-chunk quantities of the chunked gated delta rule (crates/gated_deltanet/src/delta_rule.rs,
// `Chunks::new` and the queries' part of `chunked_with`), forward only, built on chip from a
// Gated DeltaNet layer's conv output: one CTA a (sequence x value head, chunk of C = 64 steps).
// What the fused scan (gdn_scan.cu) then reads, for the chunk's steps i, j:
//
//   G_i   = g_1 + .. + g_i (inclusive cumulative log decay);  q, k L2-normalised, q * DK^-0.5
//   qd    = q_i exp(G_i)                                       [C, DK] bf16
//   intra = (q_i . k_j) exp(G_i - G_j) for j <= i, else 0      [C, C]  bf16
//   A     = beta_i (k_i . k_j) exp(G_i - G_j) for j < i         (on chip only)
//   T     = (I + A)^-1                                          (on chip only)
//   u     = T (beta v),  w = T (beta k exp(G))                  [C, DV] fp32, [C, DK] bf16
//   kte   = (k_i exp(G_last - G_i))^T                           [DK, C] bf16
//   decay = exp(G_last)                                         fp32
//
// The libtorch composite it replaces normalises q and k in fp32, repeats the key heads to the value
// heads, lays every tensor out head-first in fp32, then builds these with a dozen elementwise
// passes and batched matmuls over [B, H, n, C, C] and [B, H, n, C, D] tensors. Here the conv
// output is read once. Matmuls on tensor cores (mma.sync m16n8k16, bf16 operands, fp32
// accumulation), the triangular inverse by forward substitution in fp32, as the composite's bf16
// precision does.
//
// Compiled at run time by NVRTC (kernels/src/gdn_prep.rs) with -DDK=.. -DDV=.. (multiples of 64,
// shared memory under 48 KiB). Rows past the sequence's end are identity steps (zeros, g = 0,
// beta = 0), as the composite pads them.
//
// (u32, mma, pack, lo, hi: csrc/mma.cuh, put in front of this file.)

typedef unsigned short bf16;

#define C 64
#define WARPS 4
#define THREADS (WARPS * 32)
#define KP (DK + 8)  // shared row pitches, padded by 16 bytes: rows start 4 banks apart
#define VP (DV + 8)
#define TP (C + 8)
#define AP (C + 1)
#define ROWS_AT_ONCE 4  // rows a warp loads before normalising them (C / WARPS is a multiple)
#define MAX2(a, b) ((a) > (b) ? (a) : (b))
// One buffer holds in turn q, then A (fp32), then T (bf16), then v.
#define BUF_BYTES MAX2(MAX2(C * KP * 2, C * AP * 4), C * VP * 2)

__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ bf16 to_bf16(float x) { return (bf16)(pack(x, 0.f) & 0xffffu); }
__device__ __forceinline__ float from_bf16(bf16 x) { return __uint_as_float((u32)x << 16); }

// The A fragment of rows r0..r0+15, columns k0..k0+15 of a row-major bf16 matrix in shared memory.
__device__ __forceinline__ void load_a(u32* a, const bf16* m, int pitch, int r0, int k0, int g, int t) {
    const bf16* p = m + (r0 + g) * pitch + k0 + 2 * t;
    a[0] = *reinterpret_cast<const u32*>(p);
    a[1] = *reinterpret_cast<const u32*>(p + 8 * pitch);
    a[2] = *reinterpret_cast<const u32*>(p + 8);
    a[3] = *reinterpret_cast<const u32*>(p + 8 * pitch + 8);
}

// The B fragment of k rows k0..k0+15 and n columns n0..n0+7 of a matrix stored transposed
// (n-major: row n holds column n of B) in shared memory.
__device__ __forceinline__ void load_b(u32* b, const bf16* mt, int pitch, int k0, int n0, int g, int t) {
    const bf16* p = mt + (n0 + g) * pitch + k0 + 2 * t;
    b[0] = *reinterpret_cast<const u32*>(p);
    b[1] = *reinterpret_cast<const u32*>(p + 8);
}

// The B fragment of k rows k0..k0+15 and n columns n0..n0+7 of a row-major matrix in shared
// memory (ldmatrix transposes it), each k row scaled by f[k] and rounded to bf16 again.
__device__ __forceinline__ void load_b_rows(u32* b, const bf16* m, int pitch, int k0, int n0, const float* f, int lane,
                                            int t) {
    const bf16* p = m + (k0 + (lane & 15)) * pitch + n0;
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(b[0]), "=r"(b[1])
                 : "r"(smem(p)));
    const int k = k0 + 2 * t;
    b[0] = pack(lo(b[0]) * f[k], hi(b[0]) * f[k + 1]);
    b[1] = pack(lo(b[1]) * f[k + 8], hi(b[1]) * f[k + 9]);
}

// acc = this warp's 16 rows of T times columns n0..n0+7 of the row-major matrix m whose rows are
// scaled by f: T's fragments `at`, lower triangular, so k-steps past the warp's rows are skipped.
__device__ __forceinline__ void t_times(float* acc, const u32 (*at)[4], const bf16* m, int pitch, int n0,
                                        const float* f, int warp, int lane, int t) {
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < C / 16; kk++) {
        if (kk > warp) break;
        u32 b[2];
        load_b_rows(b, m, pitch, kk * 16, n0, f, lane, t);
        mma(acc, at[kk][0], at[kk][1], at[kk][2], at[kk][3], b[0], b[1]);
    }
}

// A row of a head L2-normalised in fp32, times `mul`: this lane's E = D / 32 elements, as E / 2
// words of two bf16, into x.
template <int E>
__device__ __forceinline__ void normalise(float* x, const u32* words, float mul) {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < E; e += 2) {
        x[e] = lo(words[e / 2]);
        x[e + 1] = hi(words[e / 2]);
        ss += x[e] * x[e] + x[e + 1] * x[e + 1];
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    const float s = rsqrtf(ss + 1e-6f) * mul;
#pragma unroll
    for (int e = 0; e < E; e++) x[e] *= s;
}

// qkv: the conv output, bf16, row (b, l) at (b * L + l) * row; head h's q at q_off + (h / rep) * DK,
// its k at k_off + (h / rep) * DK, its v at v_off + h * DV. g, beta: fp32 [BH, L]. Outputs dense,
// [BH, n, ...] as gdn_scan.cu reads them.
extern "C" __global__ void __launch_bounds__(THREADS) gdn_chunk_prep(
    const bf16* qkv, long long row, int q_off, int k_off, int v_off, int heads, int rep, const float* g,
    const float* beta, int L, int n, float scale, float* u, bf16* w, bf16* qd, bf16* intra, bf16* kte,
    float* decay) {
    const int chunk = blockIdx.x, bh = blockIdx.y, b = bh / heads, h = bh % heads;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g4 = lane / 4, t = lane % 4;
    const long long cid = (long long)bh * n + chunk, l0 = (long long)chunk * C;
    __shared__ __align__(16) bf16 ks[C * KP];                  // k, normalised
    __shared__ __align__(16) unsigned char buf[BUF_BYTES];     // q, A, T, v in turn
    __shared__ float sg[C], sb[C], sf[C];                      // G, beta, beta exp(G)
    bf16* qs = reinterpret_cast<bf16*>(buf);
    float* sa = reinterpret_cast<float*>(buf);
    bf16* ts = reinterpret_cast<bf16*>(buf);
    bf16* vs = reinterpret_cast<bf16*>(buf);

    // 1. The gates: G by an inclusive scan over the chunk (two warps of 32 steps), beta.
    float gv = 0.f, bv = 0.f;
    if (tid < C && l0 + tid < L) {
        gv = g[(long long)bh * L + l0 + tid];
        bv = beta[(long long)bh * L + l0 + tid];
    }
#pragma unroll
    for (int off = 1; off < 32; off *= 2) {
        const float y = __shfl_up_sync(0xffffffffu, gv, off);
        if (lane >= off) gv += y;
    }
    if (tid < C) {
        sg[tid] = gv;
        sb[tid] = bv;
    }
    __syncthreads();
    if (tid >= 32 && tid < C) sg[tid] += sg[31];
    __syncthreads();
    if (tid < C) sf[tid] = sb[tid] * __expf(sg[tid]);

    // 2. q and k rows normalised, a warp a row, four rows a warp at once (their loads in flight
    //    together): q into shared memory and, decayed, out as qd; k into shared memory.
    const bf16* base = qkv + (long long)b * L * row;
    const int hk = h / rep, lane_col = lane * (DK / 32);
    for (int first = warp; first < C; first += ROWS_AT_ONCE * WARPS) {
        u32 wq[ROWS_AT_ONCE][DK / 64], wk[ROWS_AT_ONCE][DK / 64];
#pragma unroll
        for (int s = 0; s < ROWS_AT_ONCE; s++) {
            const int r = first + s * WARPS;
            const bool valid = l0 + r < L;
            const bf16* at = base + (l0 + r) * row + hk * DK + lane_col;
#pragma unroll
            for (int e = 0; e < DK / 64; e++) {
                wq[s][e] = valid ? *reinterpret_cast<const u32*>(at + q_off + 2 * e) : 0u;
                wk[s][e] = valid ? *reinterpret_cast<const u32*>(at + k_off + 2 * e) : 0u;
            }
        }
#pragma unroll
        for (int s = 0; s < ROWS_AT_ONCE; s++) {
            const int r = first + s * WARPS;
            float x[DK / 32];
            normalise<DK / 32>(x, wq[s], scale);
            const float e = __expf(sg[r]);
#pragma unroll
            for (int i = 0; i < DK / 32; i += 2) {
                *reinterpret_cast<u32*>(qs + r * KP + lane_col + i) = pack(x[i], x[i + 1]);
                *reinterpret_cast<u32*>(qd + (cid * C + r) * DK + lane_col + i) = pack(x[i] * e, x[i + 1] * e);
            }
            normalise<DK / 32>(x, wk[s], 1.f);
#pragma unroll
            for (int i = 0; i < DK / 32; i += 2)
                *reinterpret_cast<u32*>(ks + r * KP + lane_col + i) = pack(x[i], x[i + 1]);
        }
    }
    __syncthreads();

    // 3. kte, transposed through shared memory (a thread a step, coalesced along the steps), and
    //    the chunk's decay.
    const float g_last = sg[C - 1];
    {
        const int r = tid % C;
        const float e = __expf(g_last - sg[r]);
        for (int d = tid / C; d < DK; d += THREADS / C)
            kte[(cid * DK + d) * C + r] = to_bf16(from_bf16(ks[r * KP + d]) * e);
        if (tid == 0) decay[cid] = __expf(g_last);
    }

    // 4. q k^T and k k^T for this warp's 16 rows (columns past them are above the diagonal).
    const int r0 = warp * 16;
    float acc_q[C / 8][4], acc_k[C / 8][4];
#pragma unroll
    for (int j = 0; j < C / 8; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc_q[j][e] = acc_k[j][e] = 0.f;
#pragma unroll 2
    for (int k0 = 0; k0 < DK; k0 += 16) {
        u32 aq[4], ak[4];
        load_a(aq, qs, KP, r0, k0, g4, t);
        load_a(ak, ks, KP, r0, k0, g4, t);
#pragma unroll
        for (int j = 0; j < C / 8; j++) {
            if (j > 2 * warp + 1) break;
            u32 bk[2];
            load_b(bk, ks, KP, k0, j * 8, g4, t);
            mma(acc_q[j], aq[0], aq[1], aq[2], aq[3], bk[0], bk[1]);
            mma(acc_k[j], ak[0], ak[1], ak[2], ak[3], bk[0], bk[1]);
        }
    }
    __syncthreads();  // q is read: the buffer takes A

    // 5. The decay mask: intra out, A into shared memory (fp32; entries above the diagonal are
    //    never read).
#pragma unroll
    for (int j = 0; j < C / 8; j++) {
        if (j > 2 * warp + 1) break;
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int i = r0 + g4 + 8 * half, c = j * 8 + 2 * t;
            float q2[2], a2[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int cc = c + e;
                const float d = cc <= i ? __expf(sg[i] - sg[cc]) : 0.f;
                q2[e] = acc_q[j][2 * half + e] * d;
                a2[e] = cc < i ? acc_k[j][2 * half + e] * d * sb[i] : 0.f;
            }
            *reinterpret_cast<u32*>(intra + (cid * C + i) * C + c) = pack(q2[0], q2[1]);
            sa[i * AP + c] = a2[0];
            sa[i * AP + c + 1] = a2[1];
        }
    }
    // intra's columns past this warp's rows are zeros too.
    for (int idx = tid; idx < C * C / 2; idx += THREADS) {
        const int i = idx / (C / 2), c = 2 * (idx % (C / 2));
        if (c / 8 > 2 * (i / 16) + 1) *reinterpret_cast<u32*>(intra + (cid * C + i) * C + c) = 0u;
    }
    __syncthreads();

    // 6. T = (I + A)^-1 by forward substitution, a thread a column, the column in registers; each
    //    row's sum in four partial sums (four dependent chains instead of one).
    float x[C];
    if (tid < C) {
#pragma unroll
        for (int i = 0; i < C; i++) {
            float v[4] = {i == tid ? 1.f : 0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int j = 0; j < i; j++) v[j % 4] -= sa[i * AP + j] * x[j];
            x[i] = (v[0] + v[1]) + (v[2] + v[3]);
        }
    }
    __syncthreads();  // A is read: the buffer takes T
    if (tid < C)
#pragma unroll
        for (int i = 0; i < C; i++) ts[i * TP + tid] = to_bf16(x[i]);
    __syncthreads();
    u32 at[C / 16][4];  // this warp's rows of T, as A fragments (T is lower triangular: k-steps <= warp)
#pragma unroll
    for (int kk = 0; kk < C / 16; kk++) load_a(at[kk], ts, TP, r0, kk * 16, g4, t);
    __syncthreads();  // T is read: the buffer takes v

    // 7. v rows (a warp a row, as stored).
#pragma unroll 4
    for (int r = warp; r < C; r += WARPS) {
        const bool valid = l0 + r < L;
        const bf16* at_v = base + (l0 + r) * row + v_off + h * DV;
#pragma unroll
        for (int i = 0; i < DV / 32; i += 2)
            *reinterpret_cast<u32*>(vs + r * VP + lane * (DV / 32) + i) =
                valid ? *reinterpret_cast<const u32*>(at_v + lane * (DV / 32) + i) : 0u;
    }
    __syncthreads();

    // 8. u = T (beta v), fp32 out; w = T (beta exp(G) k), bf16 out.
#pragma unroll 2
    for (int j = 0; j < DV / 8; j++) {
        float acc[4];
        t_times(acc, at, vs, VP, j * 8, sb, warp, lane, t);
        const int i = r0 + g4, c = j * 8 + 2 * t;
        *reinterpret_cast<float2*>(u + (cid * C + i) * DV + c) = make_float2(acc[0], acc[1]);
        *reinterpret_cast<float2*>(u + (cid * C + i + 8) * DV + c) = make_float2(acc[2], acc[3]);
    }
#pragma unroll 2
    for (int j = 0; j < DK / 8; j++) {
        float acc[4];
        t_times(acc, at, ks, KP, j * 8, sf, warp, lane, t);
        const int i = r0 + g4, c = j * 8 + 2 * t;
        *reinterpret_cast<u32*>(w + (cid * C + i) * DK + c) = pack(acc[0], acc[1]);
        *reinterpret_cast<u32*>(w + (cid * C + i + 8) * DK + c) = pack(acc[2], acc[3]);
    }
}
