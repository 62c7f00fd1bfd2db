// The tensor-core basics both attention kernel sources (block_part_mma.cu, context_tail.cu)
// share, prepended to each by its Rust module (concat!): one m16n8k16 bf16 product with fp32
// accumulators, bf16 packing and unpacking, and reductions over the 4 lanes of a fragment row.

typedef unsigned int u32;

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats as bf16 (round to nearest even), `lo` in the low half.
__device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// The low and high bf16 of a word as floats.
__device__ __forceinline__ float lo(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float hi(u32 x) { return __uint_as_float(x & 0xffff0000u); }

// Sum over the 4 lanes of a row (c = 0..3).
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
