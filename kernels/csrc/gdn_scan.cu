// The chunk-to-chunk scan of the chunked gated delta rule (crates/gated_deltanet/src/delta_rule.rs,
// `chunked_with`), forward only, fused: one CTA per (sequence x head, DVT columns of the value
// dim) keeps its slice of the state in registers across all chunks, and per chunk of C = 64 steps
//
//   v_new = u - w S                  (the chunk's corrected writes, C x DVT)
//   o     = q_decayed S + intra v_new (its outputs)
//   S     = S * decay + k_to_end v_new
//
// The libtorch loop it replaces is a dozen launches a chunk (casts, batched GEMMs and their
// copies, the outputs' concatenation); here each input is read once. Tensor cores through
// mma.sync m16n8k16 (bf16 operands, fp32 accumulation): the state and v_new enter their matmuls
// rounded to bf16 and everything else stays fp32, as in the loop's bf16 precision and FLA's kernels.
//
// Compiled at run time by NVRTC (kernels/src/gdn_scan.rs) with -DDK=.. (a multiple of 64) and
// -DDVT=.. (32 or 64). All tensors dense, [BH, n, rows, cols]:
//   u fp32 [BH, n, C, DV], w bf16 [BH, n, C, DK], qd bf16 [BH, n, C, DK], intra bf16 [BH, n, C, C],
//   kte bf16 [BH, n, DK, C], decay fp32 [BH, n], state fp32 [BH, DK, DV] (read, then the final
//   state written over it), o fp32 [BH, n * C, DV].

typedef unsigned short bf16;
typedef unsigned int u32;

#define C 64
#define WARPS 4
#define THREADS (WARPS * 32)
#define NT (DVT / 8)          // n-tiles of 8 columns
#define MS (DK / 16 / WARPS)  // state m-tiles of 16 rows a warp
#define SP (DK + 8)           // shared row pitches, padded by 16 bytes: rows start 4 banks apart
#define VP (C + 8)

__device__ __forceinline__ unsigned short bf16_bits(float x) {  // round to nearest even, NaN kept
    u32 u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return 0x7fc0u;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// d += a b, one 16 x 8 x 16 tile (fragments as the PTX ISA lays them out for m16n8k16).
__device__ __forceinline__ void mma(float* d, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The A fragment of rows r0..r0+15, columns k0..k0+15 of a row-major bf16 matrix in global memory.
__device__ __forceinline__ void load_a(u32* a, const bf16* m, int pitch, int r0, int k0, int g, int t) {
    const bf16* p = m + (long long)(r0 + g) * pitch + k0 + 2 * t;
    a[0] = __ldg(reinterpret_cast<const u32*>(p));
    a[1] = __ldg(reinterpret_cast<const u32*>(p + 8 * pitch));
    a[2] = __ldg(reinterpret_cast<const u32*>(p + 8));
    a[3] = __ldg(reinterpret_cast<const u32*>(p + 8 * pitch + 8));
}

// The B fragment of k rows k0..k0+15 and n columns n0..n0+7 of a matrix stored transposed
// (n-major, pitch `pitch`) in shared memory.
__device__ __forceinline__ void load_b(u32* b, const bf16* mt, int pitch, int k0, int n0, int g, int t) {
    const bf16* p = mt + (n0 + g) * pitch + k0 + 2 * t;
    b[0] = *reinterpret_cast<const u32*>(p);
    b[1] = *reinterpret_cast<const u32*>(p + 8);
}

extern "C" __global__ void __launch_bounds__(THREADS) gdn_scan_forward(
    const float* u, const bf16* w, const bf16* qd, const bf16* intra, const bf16* kte,
    const float* decay, float* state, float* o, int n, int dv) {
    const int bh = blockIdx.x, col0 = blockIdx.y * DVT;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    __shared__ __align__(16) bf16 s_t[DVT * SP];  // S^T, bf16: the B operand of w S and qd S
    __shared__ __align__(16) bf16 v_t[DVT * VP];  // v_new^T, bf16: the B operand of intra v_new, kte v_new

    // This warp's state rows: DK / WARPS from warp * DK / WARPS, MS tiles of 16; fp32 accumulators.
    float s[MS][NT][4];
    const float* s_in = state + (long long)bh * DK * dv + col0;
#pragma unroll
    for (int m = 0; m < MS; m++)
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int r = (warp * MS + m) * 16 + g, c = j * 8 + 2 * t;
            s[m][j][0] = s_in[(long long)r * dv + c];
            s[m][j][1] = s_in[(long long)r * dv + c + 1];
            s[m][j][2] = s_in[(long long)(r + 8) * dv + c];
            s[m][j][3] = s_in[(long long)(r + 8) * dv + c + 1];
        }

    const int row = warp * 16;  // this warp's 16 of the chunk's C rows, in phases 2 and 3
    for (int i = 0; i < n; i++) {
        const long long chunk = (long long)bh * n + i;
        // 1. S^T into shared memory, rounded to bf16.
#pragma unroll
        for (int m = 0; m < MS; m++)
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int r = (warp * MS + m) * 16 + g, c = j * 8 + 2 * t;
                s_t[c * SP + r] = bf16_bits(s[m][j][0]);
                s_t[(c + 1) * SP + r] = bf16_bits(s[m][j][1]);
                s_t[c * SP + r + 8] = bf16_bits(s[m][j][2]);
                s_t[(c + 1) * SP + r + 8] = bf16_bits(s[m][j][3]);
            }
        __syncthreads();

        // 2. w S and qd S over the DK keys, then v_new = u - w S (kept bf16 in shared memory).
        float ws[NT][4], out[NT][4];
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) ws[j][e] = out[j][e] = 0.f;
        const bf16* w_i = w + chunk * C * DK;
        const bf16* q_i = qd + chunk * C * DK;
#pragma unroll 2
        for (int k0 = 0; k0 < DK; k0 += 16) {
            u32 aw[4], aq[4];
            load_a(aw, w_i, DK, row, k0, g, t);
            load_a(aq, q_i, DK, row, k0, g, t);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                u32 b[2];
                load_b(b, s_t, SP, k0, j * 8, g, t);
                mma(ws[j], aw, b);
                mma(out[j], aq, b);
            }
        }
        const float* u_i = u + chunk * C * dv + col0;
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int r = row + g, c = j * 8 + 2 * t;
            const float2 top = *reinterpret_cast<const float2*>(u_i + (long long)r * dv + c);
            const float2 bot = *reinterpret_cast<const float2*>(u_i + (long long)(r + 8) * dv + c);
            v_t[c * VP + r] = bf16_bits(top.x - ws[j][0]);
            v_t[(c + 1) * VP + r] = bf16_bits(top.y - ws[j][1]);
            v_t[c * VP + r + 8] = bf16_bits(bot.x - ws[j][2]);
            v_t[(c + 1) * VP + r + 8] = bf16_bits(bot.y - ws[j][3]);
        }
        __syncthreads();

        // 3. o += intra v_new over the chunk's C steps; the outputs out.
        const bf16* intra_i = intra + chunk * C * C;
#pragma unroll
        for (int k0 = 0; k0 < C; k0 += 16) {
            u32 a[4];
            load_a(a, intra_i, C, row, k0, g, t);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                u32 b[2];
                load_b(b, v_t, VP, k0, j * 8, g, t);
                mma(out[j], a, b);
            }
        }
        float* o_i = o + chunk * C * dv + col0;
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int r = row + g, c = j * 8 + 2 * t;
            *reinterpret_cast<float2*>(o_i + (long long)r * dv + c) = make_float2(out[j][0], out[j][1]);
            *reinterpret_cast<float2*>(o_i + (long long)(r + 8) * dv + c) = make_float2(out[j][2], out[j][3]);
        }

        // 4. S = S * decay + kte v_new.
        const float d = decay[chunk];
        const bf16* kte_i = kte + chunk * DK * C;
#pragma unroll
        for (int m = 0; m < MS; m++) {
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[m][j][e] *= d;
#pragma unroll
            for (int k0 = 0; k0 < C; k0 += 16) {
                u32 a[4];
                load_a(a, kte_i, C, (warp * MS + m) * 16, k0, g, t);
#pragma unroll
                for (int j = 0; j < NT; j++) {
                    u32 b[2];
                    load_b(b, v_t, VP, k0, j * 8, g, t);
                    mma(s[m][j], a, b);
                }
            }
        }
        // Phase 1 of the next chunk rewrites s_t, which phase 2 read before the barrier above;
        // phase 2 rewrites v_t only after the next chunk's first barrier.
    }

    float* s_out = state + (long long)bh * DK * dv + col0;
#pragma unroll
    for (int m = 0; m < MS; m++)
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int r = (warp * MS + m) * 16 + g, c = j * 8 + 2 * t;
            s_out[(long long)r * dv + c] = s[m][j][0];
            s_out[(long long)r * dv + c + 1] = s[m][j][1];
            s_out[(long long)(r + 8) * dv + c] = s[m][j][2];
            s_out[(long long)(r + 8) * dv + c + 1] = s[m][j][3];
        }
}
