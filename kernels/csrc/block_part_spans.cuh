// What both block-part kernel sources (block_part.cu, block_part_mma.cu) share, prepended to
// each by kernels/src/block_part.rs: the context part's table and a block's view of it.

typedef unsigned short bf16;

#define MAX_RANGES 16
#define MAX_SPANS 2

// The context part, range by range as its fused kernel ran it: range r covers query rows
// start[r]..start[r] + len[r] and ran in spans[r] spans of keys, span p with output o[r][p]
// ([B, nh, len, D] bf16, strides ob, oh, on) and log-sum-exp lse[r][p] ([B, nh, len] fp32,
// dense).
struct Parts {
    int start[MAX_RANGES], len[MAX_RANGES], spans[MAX_RANGES];
    unsigned long long o[MAX_RANGES][MAX_SPANS], lse[MAX_RANGES][MAX_SPANS];
    long long ob[MAX_RANGES][MAX_SPANS], oh[MAX_RANGES][MAX_SPANS], on[MAX_RANGES][MAX_SPANS];
    int n;
};

// The context spans of the block at query row `row0`, head h of sequence b: span p's output
// from the block's first row (row i at o[p] + i on[p]) and its log-sum-exps (row i at lse[p][i]);
// n of them (0: the block sees no context).
struct BlockSpans {
    int n;
    const bf16* o[MAX_SPANS];
    long long on[MAX_SPANS];
    const float* lse[MAX_SPANS];
};

// (Unrolled: constant indices into the parameter block; an index known only at run time would
// make the compiler copy the whole block into each thread's local memory.)
__device__ __forceinline__ BlockSpans block_spans(const Parts& parts, long long row0, int b, int h, int nh) {
    BlockSpans sp;
    sp.n = 0;
#pragma unroll
    for (int r = 0; r < MAX_RANGES; r++) {
        if (r < parts.n && row0 >= parts.start[r] && row0 < parts.start[r] + parts.len[r]) {
            const long long at = row0 - parts.start[r];
            sp.n = parts.spans[r];
#pragma unroll
            for (int p = 0; p < MAX_SPANS; p++) {
                sp.o[p] = reinterpret_cast<const bf16*>(parts.o[r][p]) + b * parts.ob[r][p] + h * parts.oh[r][p] + at * parts.on[r][p];
                sp.on[p] = parts.on[r][p];
                sp.lse[p] = reinterpret_cast<const float*>(parts.lse[r][p]) + ((long long)b * nh + h) * parts.len[r] + at;
            }
        }
    }
    return sp;
}

