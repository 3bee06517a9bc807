/*
 * Hadamard rotation of activation rows (ops/hadamard.py has the construction and the oracle):
 *   out[r, :] = x[r, :] Q,   Q = I_blocks (x) (H_m (x) H_n) / sqrt(m n),  row width K = blocks * m * n.
 *
 * Each row alone, in fp32, in the order of `rotate_rows_reference` (so the two agree bit for bit
 * and no row depends on another, whatever the number of rows or threads):
 *   1. butterflies on pairs (j, j + h) inside blocks of 2h, h = 1, 2, ..., n / 2: (a + b, a - b);
 *   2. when m > 1: y[p] = s[0][p] z[0] + s[1][p] z[1] + ... (p' ascending; s = +-1, so every
 *      product is exact and only the additions round);
 *   3. one multiplication by `scale` (1 / sqrt(m n) rounded to fp32).
 * Built with -ffp-contract=off and without -ffast-math (c_build.py): no FMA, no reassociation.
 * The compiler may vectorize across elements; that never changes an element's order of operations.
 *
 * dtype of x: 0 = float32, 1 = bfloat16. Returns 0, or 1 when scratch memory cannot be allocated.
 */
#include "hadamard_rows.h"

static void rotate_row(const void *x, int dtype, float *z, float *out, int64_t blocks, int64_t m, int64_t n,
                       const float *signs, float scale) {
    rotate_row_using(x, dtype, z, out, blocks, m, n, signs, scale, 0, NULL, NULL);
}
