// A decoder layer's RMSNorm fused with the residual add next to it, one pass each way. Forward:
// s = x + delta and y = w * s / rms(s), where the add and libtorch's norm take five passes over
// the rows. Backward: dx = g + dLoss/dx of the norm (g: the residual's gradient), where libtorch's
// norm backward, its weight reduction and autograd's sum take about nine.
//
// Compiled at run time by NVRTC (kernels/src/rms_norm.rs) with -DH=.. -DCHUNKS=..; bf16 in and
// out, fp32 inside. A CTA takes a row at a time (rows of H elements, dense, 16-byte aligned);
// its thread t holds the 8-element groups t, t + THREADS, .. (CHUNKS of them at most).

// (bf16, load8, bf16_bits, store8: csrc/bf16x8.cuh, put in front of this file.)

#define THREADS 256
#define WARPS (THREADS / 32)
// CTAs an SM the backward's registers are capped for: three fit rows of up to 4,096 unspilled.
#define BACKWARD_CTAS (CHUNKS <= 2 ? 3 : 2)

__device__ __forceinline__ float round_bf16(float x) { return __uint_as_float(bf16_bits(x) << 16); }

// a and b summed over the CTA; `red` holds 2 * WARPS floats, free again on return.
__device__ __forceinline__ float2 cta_sum2(float a, float b, float* red) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
        a += __shfl_xor_sync(0xffffffffu, a, off);
        b += __shfl_xor_sync(0xffffffffu, b, off);
    }
    const int warp = threadIdx.x / 32;
    if (threadIdx.x % 32 == 0) {
        red[2 * warp] = a;
        red[2 * warp + 1] = b;
    }
    __syncthreads();
    float2 s = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < WARPS; i++) {
        s.x += red[2 * i];
        s.y += red[2 * i + 1];
    }
    __syncthreads();
    return s;
}

// The first element of this thread's group c.
__device__ __forceinline__ int column(int c) { return (c * THREADS + threadIdx.x) * 8; }

// sum = x + delta (rounded to bf16, as a separate add leaves it), y = w * sum / rms(sum).
extern "C" __global__ void __launch_bounds__(THREADS) add_rms_norm(
    const bf16* x, const bf16* delta, const bf16* w, bf16* sum, bf16* y, long long rows, float eps) {
    __shared__ float red[2 * WARPS];
    float wv[CHUNKS][8];
#pragma unroll
    for (int c = 0; c < CHUNKS; c++)
        if (column(c) < H) load8(w + column(c), wv[c]);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long at = row * H;
        float s[CHUNKS][8];
        float ss = 0.f;
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            if (column(c) >= H) continue;
            float d[8];
            load8(x + at + column(c), s[c]);
            load8(delta + at + column(c), d);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                s[c][i] = round_bf16(s[c][i] + d[i]);
                ss += s[c][i] * s[c][i];
            }
        }
        const float r = rsqrtf(cta_sum2(ss, 0.f, red).x / H + eps);
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            if (column(c) >= H) continue;
            store8(sum + at + column(c), s[c]);
#pragma unroll
            for (int i = 0; i < 8; i++) s[c][i] *= r * wv[c][i];
            store8(y + at + column(c), s[c]);
        }
    }
}

// dx = g + r * (a - xn * mean(a * xn)) with a = dy * w, r = 1 / rms(x), xn = x * r; this CTA's
// share of dLoss/dw = sum dy * xn in dw_part[blockIdx.x] (fp32, H; the caller sums them). All of
// a row's loads go out before its reduction, w is read per row (from cache) and the dw sums sit
// in shared memory (each thread its own columns): that leaves registers for three CTAs an SM
// (up to 4,096 elements a row).
// The kernel waits on memory, and more rows in flight is what speeds it.
extern "C" __global__ void __launch_bounds__(THREADS, BACKWARD_CTAS) rms_norm_backward_add(
    const bf16* x, const bf16* w, const bf16* dy, const bf16* g, bf16* dx, float* dw_part, long long rows, float eps) {
    __shared__ float red[2 * WARPS];
    // Thread t's sum for element i of its group c at dws[(c * 8 + i) * THREADS + t]: a warp's
    // accesses fall in 32 different banks.
    __shared__ float dws[CHUNKS * 8 * THREADS];
#pragma unroll
    for (int e = 0; e < CHUNKS * 8; e++) dws[e * THREADS + threadIdx.x] = 0.f;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long at = row * H;
        float xv[CHUNKS][8], dyv[CHUNKS][8], gv[CHUNKS][8];
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            if (column(c) >= H) continue;
            load8(x + at + column(c), xv[c]);
            load8(dy + at + column(c), dyv[c]);
            load8(g + at + column(c), gv[c]);
        }
        float ss = 0.f, sd = 0.f;
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            if (column(c) >= H) continue;
            float wv[8];
            load8(w + column(c), wv);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                ss += xv[c][i] * xv[c][i];
                sd += dyv[c][i] * wv[i] * xv[c][i];
            }
        }
        const float2 sums = cta_sum2(ss, sd, red);
        const float r = rsqrtf(sums.x / H + eps);
        const float k = r * r * r * sums.y / H;  // r * mean(a * xn), per unit of x
#pragma unroll
        for (int c = 0; c < CHUNKS; c++) {
            if (column(c) >= H) continue;
            float wv[8];
            load8(w + column(c), wv);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                dws[(c * 8 + i) * THREADS + threadIdx.x] += dyv[c][i] * xv[c][i] * r;
                gv[c][i] += r * dyv[c][i] * wv[i] - k * xv[c][i];
            }
            store8(dx + at + column(c), gv[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < CHUNKS; c++) {
        if (column(c) >= H) continue;
#pragma unroll
        for (int i = 0; i < 8; i++) dw_part[(long long)blockIdx.x * H + column(c) + i] = dws[(c * 8 + i) * THREADS + threadIdx.x];
    }
}
