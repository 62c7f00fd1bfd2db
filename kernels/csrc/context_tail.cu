// The context part's staircase tails on tensor cores (kernels/src/context_tail.rs). A range of
// blocks scores the context keys before its smallest anchor without a mask (its prefix, on
// cuDNN); the rest of its keys, from..from + keys, is its tail, where the block at anchor a sees
// keys from..a, all 16 of its queries alike. So a (block, kv head) is a dense problem of G x 16
// rows against its first t = a - from tail keys, only the last key tile cut. cuDNN runs a tail
// with a bias over every key at about half its unbiased rate; these kernels skip the unseen keys.
//
// - tail_forward: a CTA a (block, kv head), a warp a query head. The G warps walk the block's keys
//   in tiles of KT, K and V staged in shared memory (cp.async, STAGES deep), with an online
//   softmax -> the tail's output and log-sum-exp, merged with the other parts as cuDNN's are.
// - tail_backward_dq: the same walk with the merged log-sum-exp: P, dP = dO V^T, dS = P (dP - D)
//   scale, dq = dS K; it also writes D = rowsum(dO O) for the next kernel.
// - tail_backward_dkv: a CTA a tile of KTD keys (16 a warp, their K and V held as A fragments)
//   walks the (block, query head) tiles of 16 rows that see its keys, their Q, dO, log-sum-exps
//   and D staged STAGES_D deep: dv += P^T dO, dk += dS^T Q.
// Every range's tail in one launch (the table `Tails`). Two blocks a CTA sharing the K and V tiles
// (half the L2 traffic), and 128 keys a dkv CTA, ran slower on the H200: one CTA of 8 warps an SM
// in place of two of 4.
//
// Fragments: the PTX ISA's m16n8k16 layouts (lane = 4 g + c), B operands and the dkv kernel's A
// operands loaded from shared memory with ldmatrix. Shared tiles are rows of D bf16 whose 16-byte
// chunk ch of row r sits at ch ^ (r & 7): ldmatrix's 8 rows fall in 8 different banks.
//
// Compiled at run time by NVRTC after mma.cuh, with -DD=.. (64 or 128) -DG=.. (1..8).

typedef unsigned short bf16;

#define BK 16          // a block's queries
#define KT 32          // keys a tile of the query-major kernels
#define KTD 64         // keys a CTA of tail_backward_dkv
#define STAGES 3       // key tiles in flight in the query-major kernels (48 KiB at D = 128)
#define STAGES_D 4     // (block, head) tiles in flight in tail_backward_dkv
#define CH (D / 8)     // 16-byte chunks of a row
#define KS (D / 16)    // k-steps over d
#define ND (D / 8)     // n-tiles over d
#define LOG2E 1.4426950408889634f
#define MAX_TAILS 16
#define NEG_INF __int_as_float(0xff800000)

// Range r's tail: blocks first_block[r]..first_block[r] + blocks[r] against context keys
// from[r]..from[r] + keys[r]; the dkv kernel's CTAs first_tile[r]..first_tile[r + 1] cover its keys
// KTD at a time and write their gradients at rows out_row[r].. of dk and dv.
struct Tails {
    int first_block[MAX_TAILS], blocks[MAX_TAILS], from[MAX_TAILS], keys[MAX_TAILS];
    int first_tile[MAX_TAILS + 1], out_row[MAX_TAILS];
    int n;
};

// The tail of block j: its keys' first row and count, and how many of them it sees (0: none, or
// the block is in no tail). Unrolled over the table: constant indices into the parameter block.
struct BlockTail {
    int from, keys, t;
};

__device__ __forceinline__ BlockTail block_tail(const Tails& tails, int j, long long anchor) {
    BlockTail bt = {0, 0, 0};
#pragma unroll
    for (int r = 0; r < MAX_TAILS; r++) {
        if (r < tails.n && j >= tails.first_block[r] && j < tails.first_block[r] + tails.blocks[r]) {
            bt.from = tails.from[r];
            bt.keys = tails.keys[r];
        }
    }
    bt.t = (int)min(max(anchor - bt.from, 0ll), (long long)bt.keys);
    return bt;
}

__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32 smem(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Chunk ch of row r in a swizzled tile (uint4 units).
__device__ __forceinline__ int swz(int r, int ch) { return r * CH + (ch ^ (r & 7)); }

// Rows 0..ROWS of src (row i at src + i stride) into a swizzled tile, by NT threads; rows at or
// past `valid` are zero-filled (their keys are masked, and zeros keep 0 x V finite).
template <int ROWS, int NT>
__device__ __forceinline__ void load_tile(uint4* tile, const bf16* src, long long stride, int valid) {
#pragma unroll
    for (int it = 0; it < (ROWS * CH + NT - 1) / NT; it++) {
        const int i = it * NT + threadIdx.x;
        if (i < ROWS * CH) {
            const int r = i / CH, ch = i % CH;
            const bool ok = r < valid;
            const bf16* p = src + (ok ? r * stride : 0) + ch * 8;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem(tile + swz(r, ch))), "l"(p), "r"(ok ? 16 : 0));
        }
    }
}

__device__ __forceinline__ void cp16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem(dst)), "l"(src));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm(u32* r, const uint4* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem(p)));
}

__device__ __forceinline__ void ldsm_t(u32* r, const uint4* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem(p)));
}

// B fragments with rows row0..row0 + 8 of a tile as the n-dim and d as the k-dim (K in Q K^T):
// r[0], r[1] for k-step 2 kp, r[2], r[3] for k-step 2 kp + 1.
__device__ __forceinline__ void ld_b_rows(u32* r, const uint4* tile, int row0, int kp, int lane) {
    ldsm(r, tile + swz(row0 + (lane & 7), 4 * kp + (lane >> 3)));
}

// Rows row0..row0 + 16 of a tile, chunks 2 p, 2 p + 1 (d 16 p..16 p + 16): as an A fragment
// (rows the m-dim, r[0..3] = a0..a3), or transposed as B fragments with the rows as the k-dim
// (V in P V): r[0], r[1] for n-tile 2 p, r[2], r[3] for n-tile 2 p + 1.
__device__ __forceinline__ const uint4* rows16(const uint4* tile, int row0, int p, int lane) {
    return tile + swz(row0 + (lane & 7) + ((lane >> 3) & 1) * 8, 2 * p + (lane >> 4));
}

__device__ __forceinline__ u32 ld32(const bf16* p) { return *reinterpret_cast<const u32*>(p); }

__device__ __forceinline__ float dot2(u32 a, u32 b) { return lo(a) * lo(b) + hi(a) * hi(b); }

// Rows g, g + 8 of a 16-row tile at p (row stride n) as A fragments of the KS k-steps.
__device__ __forceinline__ void ld_a_global(u32 (*a)[4], const bf16* p, long long n, int g, int c) {
    const bf16* r = p + g * n + 2 * c;
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        a[ks][0] = ld32(r + 16 * ks);
        a[ks][1] = ld32(r + 8 * n + 16 * ks);
        a[ks][2] = ld32(r + 16 * ks + 8);
        a[ks][3] = ld32(r + 8 * n + 16 * ks + 8);
    }
}

// acc += A times B over two k-steps: A's fragments a[0], a[1], B's as ld_b_rows gives them.
__device__ __forceinline__ void mma_k2(float* acc, const u32 (*a)[4], const u32* r) {
    mma(acc, a[0][0], a[0][1], a[0][2], a[0][3], r[0], r[1]);
    mma(acc, a[1][0], a[1][1], a[1][2], a[1][3], r[2], r[3]);
}

// acc[KT / 8] = A (16 rows, all of d) times the tile's KT rows transposed.
__device__ __forceinline__ void scores(float (*acc)[4], const u32 (*a)[4], const uint4* tile, int lane) {
#pragma unroll
    for (int nt = 0; nt < KT / 8; nt++) {
        acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
        for (int kp = 0; kp < KS / 2; kp++) {
            u32 r[4];
            ld_b_rows(r, tile, nt * 8, kp, lane);
            mma_k2(acc[nt], a + 2 * kp, r);
        }
    }
}

// acc[ND] += P (16 rows x KT keys, as accumulators) times the tile (KT rows of d).
__device__ __forceinline__ void times_tile(float (*acc)[4], const float (*p)[4], const uint4* tile, int lane) {
#pragma unroll
    for (int kk = 0; kk < KT / 16; kk++) {
        const u32 a0 = pack(p[2 * kk][0], p[2 * kk][1]), a1 = pack(p[2 * kk][2], p[2 * kk][3]);
        const u32 a2 = pack(p[2 * kk + 1][0], p[2 * kk + 1][1]), a3 = pack(p[2 * kk + 1][2], p[2 * kk + 1][3]);
#pragma unroll
        for (int dp = 0; dp < ND / 2; dp++) {
            u32 r[4];
            ldsm_t(r, rows16(tile, kk * 16, dp, lane));
            mma(acc[2 * dp], a0, a1, a2, a3, r[0], r[1]);
            mma(acc[2 * dp + 1], a0, a1, a2, a3, r[2], r[3]);
        }
    }
}

// Rows g, g + 8 of acc[ND] (16 x D, scaled by f[rr]) stored as bf16 at p (row stride n).
__device__ __forceinline__ void store_rows(bf16* p, long long n, const float (*acc)[4], const float* f, int g, int c) {
#pragma unroll
    for (int rr = 0; rr < 2; rr++)
#pragma unroll
        for (int dt = 0; dt < ND; dt++)
            *reinterpret_cast<u32*>(p + (g + 8 * rr) * n + 8 * dt + 2 * c) = pack(acc[dt][2 * rr] * f[rr], acc[dt][2 * rr + 1] * f[rr]);
}

// A block's walk over the t tail keys it sees, KT at a time, K and V staged STAGES deep in
// shared memory for the CTA's warps: `begin` queues the first tiles; `next(kt)` waits for tile kt
// (every thread's copies), queues tile kt + STAGES - 1 into the stage that frees, and gives tile
// kt's stage.
struct KeyWalk {
    uint4 (*k_s)[KT * CH];
    uint4 (*v_s)[KT * CH];
    const bf16 *k, *v;  // the tail's first key
    long long kn, vn;
    int t;

    __device__ __forceinline__ int tiles() const { return (t + KT - 1) / KT; }

    // Tile kt into stage kt % STAGES: one cp.async group (empty past the last tile).
    __device__ __forceinline__ void load(int kt) const {
        if (kt < tiles()) {
            load_tile<KT, G * 32>(k_s[kt % STAGES], k + (long long)kt * KT * kn, kn, t - kt * KT);
            load_tile<KT, G * 32>(v_s[kt % STAGES], v + (long long)kt * KT * vn, vn, t - kt * KT);
        }
        cp_commit();
    }

    __device__ __forceinline__ void begin() const {
#pragma unroll
        for (int kt = 0; kt < STAGES - 1; kt++) load(kt);
    }

    __device__ __forceinline__ int next(int kt) const {
        cp_wait<STAGES - 2>();
        __syncthreads();  // tile kt is in for every thread, and tile kt - 1's stage is free
        load(kt + STAGES - 1);
        return kt % STAGES;
    }
};

// Grid (blocks A, nkv, B), G warps. q, out [B, nh, N, D] and lse [B, nh, N] (strides lb, lh) for
// all blocks; k, v [B, nkv, S, D] the context keys; anchors [B, A] (stride ab).
extern "C" __global__ void __launch_bounds__(G * 32) tail_forward(
    const bf16* __restrict__ q, long long qb, long long qh, long long qn,
    const bf16* __restrict__ k, long long kb, long long kh, long long kn,
    const bf16* __restrict__ v, long long vb, long long vh, long long vn,
    const Tails tails, const long long* __restrict__ anchors, long long ab,
    bf16* __restrict__ out, long long ob, long long oh, long long on,
    float* __restrict__ lse, long long lb, long long lh, float scale) {
    __shared__ uint4 k_s[STAGES][KT * CH], v_s[STAGES][KT * CH];
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, w = threadIdx.x >> 5;
    const int j = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, h = kvh * G + w;
    const BlockTail bt = block_tail(tails, j, anchors[b * ab + j]);
    const KeyWalk walk = {k_s, v_s, k + b * kb + kvh * kh + bt.from * kn, v + b * vb + kvh * vh + bt.from * vn, kn, vn, bt.t};
    walk.begin();
    u32 qa[KS][4];
    ld_a_global(qa, q + b * qb + h * qh + (long long)j * BK * qn, qn, g, c);

    const float sl2 = scale * LOG2E;
    float o[ND][4] = {}, m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    for (int kt = 0; kt < walk.tiles(); kt++) {
        const int st = walk.next(kt);
        float s[KT / 8][4];
        scores(s, qa, k_s[st], lane);
        // Online softmax in base 2 (accumulator e of n-tile nt: row g + 8 (e / 2), key 8 nt + 2c + e % 2).
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            float mx = m[rr];
#pragma unroll
            for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float& x = s[nt][2 * rr + e];
                    x = kt * KT + nt * 8 + 2 * c + e < bt.t ? x * sl2 : NEG_INF;
                    mx = fmaxf(mx, x);
                }
            mx = quad_max(mx);  // finite: the first tile's key 0 is seen
            const float corr = exp2_approx(m[rr] - mx);
            m[rr] = mx;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float& x = s[nt][2 * rr + e];
                    x = exp2_approx(x - mx);
                    sum += x;
                }
            l[rr] = l[rr] * corr + sum;  // this lane's share; summed over the quad at the end
#pragma unroll
            for (int dt = 0; dt < ND; dt++) o[dt][2 * rr] *= corr, o[dt][2 * rr + 1] *= corr;
        }
        times_tile(o, s, v_s[st], lane);
    }
    // A block that sees no key of its tail: output 0, log-sum-exp -inf (it weighs nothing).
    float inv[2];
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        const float sum = quad_sum(l[rr]);
        inv[rr] = bt.t > 0 ? 1.f / sum : 0.f;
        if (c == 0) lse[b * lb + h * lh + j * BK + g + 8 * rr] = bt.t > 0 ? (m[rr] + log2f(sum)) / LOG2E : NEG_INF;
    }
    store_rows(out + b * ob + h * oh + (long long)j * BK * on, on, o, inv, g, c);
}

// Grid (blocks A, nkv, B), G warps. As tail_forward, with d_out and out [B, nh, N, D], the merged
// log-sum-exp; writes dq [B, nh, N, D] (zeros for a block that sees no tail key) and dsum = D
// [B, nh, N] (strides lb, lh, as lse's).
extern "C" __global__ void __launch_bounds__(G * 32) tail_backward_dq(
    const bf16* __restrict__ q, long long qb, long long qh, long long qn,
    const bf16* __restrict__ k, long long kb, long long kh, long long kn,
    const bf16* __restrict__ v, long long vb, long long vh, long long vn,
    const bf16* __restrict__ d_out, long long db, long long dh, long long dn,
    const bf16* __restrict__ out, long long ob, long long oh, long long on,
    const float* __restrict__ lse, float* __restrict__ dsum, long long lb, long long lh,
    const Tails tails, const long long* __restrict__ anchors, long long ab,
    bf16* __restrict__ dq, long long gb, long long gh, long long gn, float scale) {
    __shared__ uint4 k_s[STAGES][KT * CH], v_s[STAGES][KT * CH];
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, w = threadIdx.x >> 5;
    const int j = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, h = kvh * G + w;
    const BlockTail bt = block_tail(tails, j, anchors[b * ab + j]);
    const KeyWalk walk = {k_s, v_s, k + b * kb + kvh * kh + bt.from * kn, v + b * vb + kvh * vh + bt.from * vn, kn, vn, bt.t};
    walk.begin();
    // Q and dO as A fragments; D = rowsum(dO O) from O's same elements.
    u32 qa[KS][4], da[KS][4];
    ld_a_global(qa, q + b * qb + h * qh + (long long)j * BK * qn, qn, g, c);
    const bf16* dop = d_out + b * db + h * dh + (long long)j * BK * dn;
    ld_a_global(da, dop, dn, g, c);
    float d_row[2], l2[2];
    {
        u32 oa[KS][4];
        ld_a_global(oa, out + b * ob + h * oh + (long long)j * BK * on, on, g, c);
        float part[2] = {0.f, 0.f};
#pragma unroll
        for (int ks = 0; ks < KS; ks++) {
            part[0] += dot2(da[ks][0], oa[ks][0]) + dot2(da[ks][2], oa[ks][2]);
            part[1] += dot2(da[ks][1], oa[ks][1]) + dot2(da[ks][3], oa[ks][3]);
        }
#pragma unroll
        for (int rr = 0; rr < 2; rr++) {
            const long long at = b * lb + h * lh + j * BK + g + 8 * rr;
            d_row[rr] = quad_sum(part[rr]);
            l2[rr] = lse[at] * LOG2E;
            if (c == 0) dsum[at] = d_row[rr];
        }
    }

    const float sl2 = scale * LOG2E;
    float acc[ND][4] = {};
    for (int kt = 0; kt < walk.tiles(); kt++) {
        const int st = walk.next(kt);
        float s[KT / 8][4], dp[KT / 8][4];
        scores(s, qa, k_s[st], lane);
        scores(dp, da, v_s[st], lane);
#pragma unroll
        for (int nt = 0; nt < KT / 8; nt++)
#pragma unroll
            for (int a = 0; a < 4; a++) {
                const int rr = a >> 1;
                const float p = kt * KT + nt * 8 + 2 * c + (a & 1) < bt.t ? exp2_approx(s[nt][a] * sl2 - l2[rr]) : 0.f;
                dp[nt][a] = p * (dp[nt][a] - d_row[rr]) * scale;
            }
        times_tile(acc, dp, k_s[st], lane);
    }
    const float one[2] = {1.f, 1.f};
    store_rows(dq + b * gb + h * gh + (long long)j * BK * gn, gn, acc, one, g, c);
}

// Grid (the table's tiles of KTD keys, nkv, B), 4 warps. Inputs as tail_backward_dq's, with its
// dsum; writes dk, dv [B, nkv, rows, D] (strides kgb, kgh, kgn; range r's keys at rows
// out_row[r]..).
extern "C" __global__ void __launch_bounds__(128) tail_backward_dkv(
    const bf16* __restrict__ q, long long qb, long long qh, long long qn,
    const bf16* __restrict__ k, long long kb, long long kh, long long kn,
    const bf16* __restrict__ v, long long vb, long long vh, long long vn,
    const bf16* __restrict__ d_out, long long db, long long dh, long long dn,
    const float* __restrict__ lse, const float* __restrict__ dsum, long long lb, long long lh,
    const Tails tails, const long long* __restrict__ anchors, long long ab,
    bf16* __restrict__ dk, bf16* __restrict__ dv, long long kgb, long long kgh, long long kgn, float scale) {
    // The K and V tile first; then STAGES_D stages of a (block, head)'s Q and dO rows, with their
    // log-sum-exps and D.
    constexpr int STAGE = 2 * BK * CH + 8;
    __shared__ uint4 sm[2 * KTD * CH > STAGES_D * STAGE ? 2 * KTD * CH : STAGES_D * STAGE];
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, w = threadIdx.x >> 5;
    const int x = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    int first = 0, blocks = 0, from = 0, keys = 0, kt0 = 0, out_row = 0;
#pragma unroll
    for (int r = 0; r < MAX_TAILS; r++) {
        if (r < tails.n && x >= tails.first_tile[r] && x < tails.first_tile[r + 1]) {
            first = tails.first_block[r], blocks = tails.blocks[r], from = tails.from[r], keys = tails.keys[r];
            kt0 = (x - tails.first_tile[r]) * KTD, out_row = tails.out_row[r];
        }
    }
    const int valid = min(KTD, keys - kt0);
    load_tile<KTD, 128>(sm, k + b * kb + kvh * kh + (long long)(from + kt0) * kn, kn, valid);
    load_tile<KTD, 128>(sm + KTD * CH, v + b * vb + kvh * vh + (long long)(from + kt0) * vn, vn, valid);
    cp_commit();
    cp_wait<0>();
    __syncthreads();
    u32 ka[KS][4], va[KS][4];
#pragma unroll
    for (int ks = 0; ks < KS; ks++) {
        ldsm(ka[ks], rows16(sm, 16 * w, ks, lane));
        ldsm(va[ks], rows16(sm + KTD * CH, 16 * w, ks, lane));
    }
    __syncthreads();

    // The blocks that see key kt0 (their anchor past it), each for its G heads: tile i = (block
    // first + i / G, head kvh G + i % G).
    const long long* anc = anchors + b * ab + first;
    auto next = [&](int i) {
        for (; i < blocks * G; i = (i / G + 1) * G)
            if (anc[i / G] - from > kt0) return i;
        return blocks * G;
    };
    auto after = [&](int i) { return (i + 1) % G ? i + 1 : next(i + 1); };
    const int end = blocks * G;
    // Tile i (if any) into stage st: one cp.async group (empty past the last).
    auto load = [&](int i, int st) {
        if (i < end) {
            const long long row = (long long)(first + i / G) * BK;
            const int h = kvh * G + i % G;
            uint4* stage = sm + st * STAGE;
            load_tile<BK, 128>(stage, q + b * qb + h * qh + row * qn, qn, BK);
            load_tile<BK, 128>(stage + BK * CH, d_out + b * db + h * dh + row * dn, dn, BK);
            if (threadIdx.x < 8) cp16(stage + 2 * BK * CH + threadIdx.x, (threadIdx.x < 4 ? lse : dsum) + b * lb + h * lh + row + 4 * (threadIdx.x & 3));
        }
        cp_commit();
    };
    const float sl2 = scale * LOG2E;
    float ak[ND][4] = {}, av[ND][4] = {};
    int i = next(0), ahead = i;
#pragma unroll
    for (int st = 0; st < STAGES_D - 1; st++) {
        load(ahead, st);
        if (ahead < end) ahead = after(ahead);
    }
    for (int n = 0; i < end; n++) {
        const int st = n % STAGES_D;
        cp_wait<STAGES_D - 2>();
        __syncthreads();  // tile i is in for every thread, and the last tile's stage is free
        load(ahead, (n + STAGES_D - 1) % STAGES_D);
        if (ahead < end) ahead = after(ahead);
        const uint4* qs = sm + st * STAGE;
        const uint4* ds = qs + BK * CH;
        const float* ls = reinterpret_cast<const float*>(qs + 2 * BK * CH);
        const int t = (int)min(anc[i / G] - from, (long long)keys);
        // S^T and dP^T: rows this warp's keys 16 w + g (+ 8), columns the 16 queries (n-tile nq:
        // 8 nq + 2c + e).
        float s[2][4] = {}, dp[2][4] = {};
#pragma unroll
        for (int nq = 0; nq < 2; nq++)
#pragma unroll
            for (int kp = 0; kp < KS / 2; kp++) {
                u32 r[4];
                ld_b_rows(r, qs, nq * 8, kp, lane);
                mma_k2(s[nq], ka + 2 * kp, r);
                ld_b_rows(r, ds, nq * 8, kp, lane);
                mma_k2(dp[nq], va + 2 * kp, r);
            }
#pragma unroll
        for (int nq = 0; nq < 2; nq++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const float l2 = ls[8 * nq + 2 * c + e] * LOG2E, d_row = ls[16 + 8 * nq + 2 * c + e];
#pragma unroll
                for (int rr = 0; rr < 2; rr++) {
                    const int a = 2 * rr + e;
                    const float p = kt0 + 16 * w + g + 8 * rr < t ? exp2_approx(s[nq][a] * sl2 - l2) : 0.f;
                    s[nq][a] = p;
                    dp[nq][a] = p * (dp[nq][a] - d_row) * scale;
                }
            }
        // dv += P^T dO, dk += dS^T Q: P^T and dS^T as A fragments straight from the accumulators
        // (k-dim the 16 queries), dO and Q transposed from the stage.
        const u32 p0 = pack(s[0][0], s[0][1]), p1 = pack(s[0][2], s[0][3]), p2 = pack(s[1][0], s[1][1]), p3 = pack(s[1][2], s[1][3]);
        const u32 d0 = pack(dp[0][0], dp[0][1]), d1 = pack(dp[0][2], dp[0][3]), d2 = pack(dp[1][0], dp[1][1]), d3 = pack(dp[1][2], dp[1][3]);
#pragma unroll
        for (int p = 0; p < ND / 2; p++) {
            u32 r[4];
            ldsm_t(r, rows16(ds, 0, p, lane));
            mma(av[2 * p], p0, p1, p2, p3, r[0], r[1]);
            mma(av[2 * p + 1], p0, p1, p2, p3, r[2], r[3]);
            ldsm_t(r, rows16(qs, 0, p, lane));
            mma(ak[2 * p], d0, d1, d2, d3, r[0], r[1]);
            mma(ak[2 * p + 1], d0, d1, d2, d3, r[2], r[3]);
        }
        i = after(i);
    }
    // This warp's 16 keys (those past the tail's end not written).
#pragma unroll
    for (int rr = 0; rr < 2; rr++) {
        const int key = kt0 + 16 * w + g + 8 * rr;
        if (key < keys) {
            const long long at = b * kgb + kvh * kgh + (long long)(out_row + key) * kgn + 2 * c;
#pragma unroll
            for (int dt = 0; dt < ND; dt++) {
                *reinterpret_cast<u32*>(dk + at + 8 * dt) = pack(ak[dt][2 * rr], ak[dt][2 * rr + 1]);
                *reinterpret_cast<u32*>(dv + at + 8 * dt) = pack(av[dt][2 * rr], av[dt][2 * rr + 1]);
            }
        }
    }
}
