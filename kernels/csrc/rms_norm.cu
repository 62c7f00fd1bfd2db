// A decoder layer's RMSNorm fused with the residual add next to it, one pass each way. Forward:
// s = x + delta and y = w * s / rms(s), where the add and libtorch's norm take five passes over
// the rows. Backward: dx = g + dLoss/dx of the norm (g: the residual's gradient), where libtorch's
// norm backward, its weight reduction and autograd's sum take about nine.
//
// Compiled at run time by NVRTC (kernels/src/rms_norm.rs) with -DH=.. -DTHREADS=..; bf16 in and
// out, fp32 inside. A CTA takes a row at a time (rows of H elements, dense, 16-byte aligned), a
// thread one 8-element group of it (THREADS = H / 8 rounded up to whole warps, H up to 8,192):
// few registers a thread, so many rows in flight an SM. The kernels wait on memory, and rows in
// flight are what speeds them.

// (bf16, load8, bf16_bits, store8: csrc/bf16x8.cuh, put in front of this file.)

#define WARPS (THREADS / 32)
// CTAs an SM the registers are capped for: 1,536 threads' worth.
#define MIN_CTAS (1536 / THREADS < 8 ? 1536 / THREADS : 8)

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

// sum = x + delta (rounded to bf16, as a separate add leaves it), y = w * sum / rms(sum).
extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS) add_rms_norm(
    const bf16* x, const bf16* delta, const bf16* w, bf16* sum, bf16* y, long long rows, float eps) {
    __shared__ float red[2 * WARPS];
    const int col = threadIdx.x * 8;
    const bool mine = col < H;  // the last warp's tail threads hold no group
    float wv[8];
    if (mine) load8(w + col, wv);
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long at = row * H + col;
        float s[8], d[8];
        float ss = 0.f;
        if (mine) {
            load8(x + at, s);
            load8(delta + at, d);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                s[i] = round_bf16(s[i] + d[i]);
                ss += s[i] * s[i];
            }
        }
        const float r = rsqrtf(cta_sum2(ss, 0.f, red).x / H + eps);
        if (mine) {
            store8(sum + at, s);
#pragma unroll
            for (int i = 0; i < 8; i++) s[i] *= r * wv[i];
            store8(y + at, s);
        }
    }
}

// dx = g + r * (a - xn * mean(a * xn)) with a = dy * w, r = 1 / rms(x), xn = x * r; this CTA's
// share of dLoss/dw = sum dy * xn in dw_part[blockIdx.x] (fp32, H; the caller sums them). All of
// a row's loads go out before its reduction; w is read per row (from cache) and the dw sums sit
// in shared memory, to keep registers few.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_CTAS) rms_norm_backward_add(
    const bf16* x, const bf16* w, const bf16* dy, const bf16* g, bf16* dx, float* dw_part, long long rows, float eps) {
    __shared__ float red[2 * WARPS];
    // Thread t's sum for element i of its group at dws[i * THREADS + t]: a warp's accesses fall
    // in 32 different banks.
    __shared__ float dws[8 * THREADS];
    const int col = threadIdx.x * 8;
    const bool mine = col < H;
#pragma unroll
    for (int i = 0; i < 8; i++) dws[i * THREADS + threadIdx.x] = 0.f;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long at = row * H + col;
        float xv[8], dyv[8], gv[8], wv[8];
        float ss = 0.f, sd = 0.f;
        if (mine) {
            load8(x + at, xv);
            load8(dy + at, dyv);
            load8(g + at, gv);
            load8(w + col, wv);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                ss += xv[i] * xv[i];
                sd += dyv[i] * wv[i] * xv[i];
            }
        }
        const float2 sums = cta_sum2(ss, sd, red);
        const float r = rsqrtf(sums.x / H + eps);
        const float k = r * r * r * sums.y / H;  // r * mean(a * xn), per unit of x
        if (mine) {
            load8(w + col, wv);
#pragma unroll
            for (int i = 0; i < 8; i++) {
                dws[i * THREADS + threadIdx.x] += dyv[i] * xv[i] * r;
                gv[i] += r * dyv[i] * wv[i] - k * xv[i];
            }
            store8(dx + at, gv);
        }
    }
    if (mine)
#pragma unroll
        for (int i = 0; i < 8; i++) dw_part[(long long)blockIdx.x * H + col + i] = dws[i * THREADS + threadIdx.x];
}
