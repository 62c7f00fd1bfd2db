// A Gated DeltaNet layer's output gate (plugins/target_hf/src/qwen3_5.rs, step 5) in one pass, forward
// only: what `gated_deltanet::gated_rms_norm` runs on a GPU in place of libtorch's transpose, norm,
// SiLU, product and cast.
//
// Compiled at run time by NVRTC (kernels/src/gdn_prep.rs) with -DDV=.. (a multiple of 64: a lane
// takes DV / 32 values, in pairs).
//
// (u32, pack, lo, hi: csrc/mma.cuh, put in front of this file.)

typedef unsigned short bf16;

#define WARPS 4
#define THREADS (WARPS * 32)

// The layer's gated RMSNorm over the scan's outputs: y = rmsnorm(o) * weight * silu(z), a warp a
// (sequence, step, value head) row of DV. o fp32 [BH, Lp, DV] (the scan's layout), z bf16 with
// row (b, l) at (b * L + l) * z_row and head h at h * DV, weight fp32 [DV]; y bf16 [B, L, H * DV].
// silu(z) is rounded to bf16 before the product, as the composite computes it in z's dtype.
extern "C" __global__ void __launch_bounds__(THREADS) gdn_gated_norm(
    const float* o, const bf16* z, long long z_row, const float* weight, bf16* y, int L, int Lp, int heads,
    long long rows, float eps) {
    const int lane = threadIdx.x % 32;
    for (long long r = (long long)blockIdx.x * WARPS + threadIdx.x / 32; r < rows; r += (long long)gridDim.x * WARPS) {
        const int h = (int)(r % heads);
        const long long bl = r / heads, b = bl / L, l = bl % L;
        const float* orow = o + ((b * heads + h) * Lp + l) * DV + lane * (DV / 32);
        const bf16* zrow = z + bl * z_row + h * DV + lane * (DV / 32);
        float x[DV / 32], ss = 0.f;
#pragma unroll
        for (int e = 0; e < DV / 32; e++) {
            x[e] = orow[e];
            ss += x[e] * x[e];
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float s = rsqrtf(ss / DV + eps);
        bf16* yrow = y + bl * heads * DV + h * DV + lane * (DV / 32);
#pragma unroll
        for (int e = 0; e < DV / 32; e += 2) {
            const u32 zz = *reinterpret_cast<const u32*>(zrow + e);
            float out[2];
#pragma unroll
            for (int k = 0; k < 2; k++) {
                const float zv = k == 0 ? lo(zz) : hi(zz);
                const float gate = lo(pack(zv / (1.f + __expf(-zv)), 0.f));  // rounded to bf16
                out[k] = x[e + k] * s * weight[lane * (DV / 32) + e + k] * gate;
            }
            *reinterpret_cast<u32*>(yrow + e) = pack(out[0], out[1]);
        }
    }
}
