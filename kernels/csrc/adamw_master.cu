// One AdamW step of a bf16 parameter with an fp32 master copy, in one pass: the bf16 gradient
// read and widened in registers, the master, moments and the bf16 parameter written once. The
// libtorch path it replaces takes three: the gradient cast to fp32, the fused AdamW kernel over
// the masters, and the masters copied back into the parameters.
//
// Compiled at run time by NVRTC (kernels/src/adamw.rs). The formula is torch's fused AdamW's
// (ATen's fused_adam_utils.cuh, ADAMW mode), in the same order: decay, moments, the bias-corrected
// step; in fp32 throughout (torch takes its scalars in double), so equal to fp32 rounding. Tensors dense, n elements each.

typedef unsigned short bf16;

__device__ __forceinline__ unsigned short bf16_round(float x) {  // round to nearest even, NaN kept
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return 0x7fc0u;
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

struct Hyper {
    float lr, beta1, beta2, weight_decay, eps, step_size, bc2_sqrt;
};

// One element: the master p and moments m, v updated in place from the gradient g.
__device__ __forceinline__ void update(float g, float& p, float& m, float& v, const Hyper& h) {
    p -= h.lr * h.weight_decay * p;
    m = h.beta1 * m + (1.f - h.beta1) * g;
    v = h.beta2 * v + (1.f - h.beta2) * g * g;
    const float denom = sqrtf(v) / h.bc2_sqrt + h.eps;
    p -= h.step_size * m / denom;
}

// step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t). The first 4 * n4 elements 4 at a
// time (16-byte loads of the fp32 tensors, 8-byte of the bf16 ones: n4 is 0 unless all five are
// 16-byte aligned), the rest one at a time.
extern "C" __global__ void adamw_master_step(const bf16* grad, float* master, float* exp_avg, float* exp_avg_sq, bf16* param,
                                             long long n, long long n4, float lr, float beta1, float beta2, float weight_decay,
                                             float eps, float step_size, float bc2_sqrt) {
    const Hyper h = {lr, beta1, beta2, weight_decay, eps, step_size, bc2_sqrt};
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = first; i < n4; i += stride) {
        const uint2 gw = reinterpret_cast<const uint2*>(grad)[i];
        float4 p = reinterpret_cast<float4*>(master)[i], m = reinterpret_cast<float4*>(exp_avg)[i],
               v = reinterpret_cast<float4*>(exp_avg_sq)[i];
        update(__uint_as_float(gw.x << 16), p.x, m.x, v.x, h);
        update(__uint_as_float(gw.x & 0xffff0000u), p.y, m.y, v.y, h);
        update(__uint_as_float(gw.y << 16), p.z, m.z, v.z, h);
        update(__uint_as_float(gw.y & 0xffff0000u), p.w, m.w, v.w, h);
        reinterpret_cast<float4*>(master)[i] = p;
        reinterpret_cast<float4*>(exp_avg)[i] = m;
        reinterpret_cast<float4*>(exp_avg_sq)[i] = v;
        reinterpret_cast<uint2*>(param)[i] = make_uint2(bf16_round(p.x) | ((unsigned)bf16_round(p.y) << 16),
                                                        bf16_round(p.z) | ((unsigned)bf16_round(p.w) << 16));
    }
    for (long long i = 4 * n4 + first; i < n; i += stride) {
        float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
        update(__uint_as_float((unsigned)grad[i] << 16), p, m, v, h);
        master[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = bf16_round(p);
    }
}
