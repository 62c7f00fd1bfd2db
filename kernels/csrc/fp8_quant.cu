// Activations quantised to FP8 (e4m3) per token per group of 128 input channels, in one pass, as
// FP8 block-scaled checkpoints are served (DeepSeek's recipe, SGLang's and vLLM's arithmetic): a
// group's scale is s = max(amax, 1e-10) / 448 and its values x / s, both correctly rounded, then
// rounded to e4m3, nearest even, saturating (|x / s| exceeds 448 only by rounding). The scales land in the layout libtorch's block-scaled `_scaled_mm` wants for its
// left operand: [groups][rows_p], i.e. a [rows_p, groups] matrix with the rows contiguous.
//
// Compiled at run time by NVRTC for compute_90 (kernels/src/fp8.rs): the e4m3 conversion is the
// hardware's `cvt.rn.satfinite.e4m3x2.f32` (sm_89 and later). A group is 16 threads of 8
// elements (16-byte loads); a warp two groups, one after the other in the same column of groups.

// (bf16, load8: csrc/bf16x8.cuh, put in front of this file.)

#define GROUP 128
#define LANES 16
#define E4M3_MAX 448.f
// amax floor: a group of zeros gets a tiny finite scale and zeros (as SGLang's eps).
#define AMAX_FLOOR 1e-10f

// Two floats to two e4m3 bytes, `lo` in the low byte (the first in memory).
__device__ __forceinline__ unsigned e4m3x2(float lo, float hi) {
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}

// x [rows, k] bf16 with row stride ldx (elements; the last dim dense, 16-byte aligned, k % 8 == 0)
// -> q [rows_p, groups * 128] e4m3 (dense), scales [groups, rows_p] f32. Rows past `rows` and
// columns past `k` are written as zeros. rows_p is even, so a warp's two groups are both live or
// both past the end.
extern "C" __global__ void fp8_quantize_act(const bf16* __restrict__ x, long long ldx, int rows, int k,
                                            unsigned char* __restrict__ q, float* __restrict__ scales, int rows_p,
                                            int groups) {
    const long long items = (long long)groups * rows_p;
    const int lane = threadIdx.x % LANES;
    const long long first = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / LANES;
    const long long step = (long long)gridDim.x * blockDim.x / LANES;
    const long long kp = (long long)groups * GROUP;
    for (long long item = first; item < items; item += step) {
        const int g = (int)(item / rows_p), r = (int)(item % rows_p);
        const int col = g * GROUP + lane * 8;
        float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (r < rows && col < k) load8(x + r * ldx + col, v);
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) amax = fmaxf(amax, fabsf(v[j]));
#pragma unroll
        for (int o = LANES / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        amax = fmaxf(amax, AMAX_FLOOR);
        const float s = __fdiv_rn(amax, E4M3_MAX);
        float y[8];
#pragma unroll
        for (int j = 0; j < 8; j++) y[j] = __fdiv_rn(v[j], s);
        const unsigned w0 = e4m3x2(y[0], y[1]) | (e4m3x2(y[2], y[3]) << 16);
        const unsigned w1 = e4m3x2(y[4], y[5]) | (e4m3x2(y[6], y[7]) << 16);
        *reinterpret_cast<uint2*>(q + r * kp + col) = make_uint2(w0, w1);
        if (lane == 0) scales[item] = s;
    }
}
