// (I + A)^{-1} for strictly lower-triangular A [N, C, C] (fp32, dense), the WY system of the
// chunked gated delta rule (crates/gated_deltanet/src/delta_rule.rs, `unit_lower_inverse`), by
// forward substitution on chip: one CTA a matrix, one thread a column of the inverse X,
//   X[i][c] = [i == c] - sum_{j < i} A[i][j] X[j][c],
// rows in order. Every thread runs the same j loop (X[j][c] = 0 above the diagonal), so A[i][j]
// is one broadcast read and X's rows are read without bank conflicts. The libtorch composite it
// replaces is 15 row-by-row matrix-vector steps for the 16 x 16 diagonal blocks, then the block rows.
//
// Compiled at run time by NVRTC (kernels/src/unit_lower_inverse.rs) with -DC=.. (<= 64).

extern "C" __global__ void __launch_bounds__(C) unit_lower_inverse(const float* a, float* x) {
    __shared__ float sa[C][C + 1], sx[C][C + 1];
    const long long base = (long long)blockIdx.x * C * C;
    const int c = threadIdx.x;
    for (int r = 0; r < C; r++) sa[r][c] = a[base + (long long)r * C + c];
    __syncthreads();
    for (int i = 0; i < C; i++) {
        float v = i == c ? 1.f : 0.f;
        for (int j = 0; j < i; j++) v -= sa[i][j] * sx[j][c];
        sx[i][c] = v;  // read back only by this thread
    }
    for (int r = 0; r < C; r++) x[base + (long long)r * C + c] = sx[r][c];
}
