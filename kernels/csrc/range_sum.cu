// The context part's gradients summed over its runs (kernels/src/block_attention.rs): each run
// of the fused attention kernel yields dq for its range's query rows, dk and dv for its span of
// context keys; spans of different ranges overlap. One pass sums, for every output row, the runs
// that cover it, in fp32, and writes it once in bf16 (rows no run covers get zeros): in place of
// fp32 accumulators, an add per run and a cast at the end.
//
// Compiled at run time by NVRTC (kernels/src/range_sum.rs) with -DD=..; a row of D elements is
// D / 8 threads, 8 elements (16 bytes) each.

typedef unsigned short bf16;

#define MAX_RUNS 32
#define ROW (D / 8)

// Run r: a [B, H, len[r], D] bf16 tensor at ptr[r] with strides sb, sh, sl (the last dim dense),
// covering output rows from[r]..from[r] + len[r].
struct Runs {
    unsigned long long ptr[MAX_RUNS];
    long long sb[MAX_RUNS], sh[MAX_RUNS], sl[MAX_RUNS];
    int from[MAX_RUNS], len[MAX_RUNS];
    int n;
};

__device__ __forceinline__ unsigned bf16_bits(float x) {  // round to nearest even, NaN kept
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// out [B, H, rows, D] (strides ob, oh, ol; the last dim dense). Grid (ceil(rows / rows a CTA), H, B).
extern "C" __global__ void range_sum(const Runs runs, bf16* out, long long ob, long long oh, long long ol, int rows) {
    const int l = blockIdx.x * (blockDim.x / ROW) + threadIdx.x / ROW;
    if (l >= rows) return;
    const int d = (threadIdx.x % ROW) * 8;
    const long long h = blockIdx.y, b = blockIdx.z;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    // Unrolled: constant indices into the parameter block (an index known only at run time would
    // copy the block into each thread's local memory).
#pragma unroll
    for (int r = 0; r < MAX_RUNS; r++) {
        if (r >= runs.n) break;
        const int i = l - runs.from[r];
        if (i < 0 || i >= runs.len[r]) continue;
        const bf16* p = reinterpret_cast<const bf16*>(runs.ptr[r]) + b * runs.sb[r] + h * runs.sh[r] + i * runs.sl[r] + d;
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            acc[2 * j] += __uint_as_float(w[j] << 16);
            acc[2 * j + 1] += __uint_as_float(w[j] & 0xffff0000u);
        }
    }
    unsigned w[4];
#pragma unroll
    for (int j = 0; j < 4; j++) w[j] = bf16_bits(acc[2 * j]) | (bf16_bits(acc[2 * j + 1]) << 16);
    *reinterpret_cast<uint4*>(out + b * ob + h * oh + l * ol + d) = make_uint4(w[0], w[1], w[2], w[3]);
}
