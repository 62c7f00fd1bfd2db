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

// step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t).
extern "C" __global__ void adamw_master_step(const bf16* grad, float* master, float* exp_avg, float* exp_avg_sq, bf16* param,
                                             long long n, float lr, float beta1, float beta2, float weight_decay, float eps,
                                             float step_size, float bc2_sqrt) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const float g = __uint_as_float((unsigned)grad[i] << 16);
        float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
        p -= lr * weight_decay * p;
        m = beta1 * m + (1.f - beta1) * g;
        v = beta2 * v + (1.f - beta2) * g * g;
        const float denom = sqrtf(v) / bc2_sqrt + eps;
        p -= step_size * m / denom;
        master[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = bf16_round(p);
    }
}
