// bf16 as fp32, one element or 8 at a time (16-byte loads and stores), for the kernels that move
// bf16 rows: put in front of swiglu.cu, rms_norm.cu and cross_entropy.cu by their Rust modules (concat!).

typedef unsigned short bf16;

__device__ __forceinline__ float bf16_float(bf16 x) { return __uint_as_float((unsigned)x << 16); }

__device__ __forceinline__ void load8(const bf16* p, float* x) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        x[2 * i] = __uint_as_float(w[i] << 16);
        x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

__device__ __forceinline__ unsigned bf16_bits(float x) {  // round to nearest even, NaN kept
    unsigned u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x7fffffu)) return 0x7fc0u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

__device__ __forceinline__ void store8(bf16* p, const float* x) {
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = bf16_bits(x[2 * i]) | (bf16_bits(x[2 * i + 1]) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
