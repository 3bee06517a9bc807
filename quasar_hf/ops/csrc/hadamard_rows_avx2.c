/*
 * AVX2 build of csrc/hadamard_rows.c: the same rotation with the same bits (each element's fp32
 * operations and their order are those of hadamard_rows.c and `rotate_rows_reference`):
 *   - butterflies h = 1, 2, 4 inside each 8-float register by lane permutes (a + b, a - b), then
 *     h >= 8 on whole registers;
 *   - the +-1 mix as fma(s, z, acc): bitwise acc + s * z, since s * z = +-z is exact;
 *   - one multiplication by `scale`.
 * Rows of fewer than 8 floats per Sylvester block take the portable loops.
 */
#include <immintrin.h>
#include "hadamard_rows.h"

/* One butterfly stage of span h < 8 inside a register: lanes with bit h clear get a + b, the others a - b
 * (a the lane with the bit clear, b its partner). */
static inline __m256 stage_in_register(__m256 v, __m256 partner, int blend_mask_upper) {
    __m256 sum = _mm256_add_ps(v, partner);  /* lower lanes: a + b (b + a is the same bits) */
    __m256 diff = _mm256_sub_ps(partner, v); /* upper lanes: partner = a, v = b: a - b */
    switch (blend_mask_upper) {
    case 0xAA: return _mm256_blend_ps(sum, diff, 0xAA);
    case 0xCC: return _mm256_blend_ps(sum, diff, 0xCC);
    default: return _mm256_blend_ps(sum, diff, 0xF0);
    }
}

static void butterflies_avx2(float *z, int64_t n) {
    for (int64_t j = 0; j < n; j += 8) {
        __m256 v = _mm256_loadu_ps(z + j);
        v = stage_in_register(v, _mm256_permute_ps(v, 0xB1), 0xAA);                 /* h = 1 */
        v = stage_in_register(v, _mm256_permute_ps(v, 0x4E), 0xCC);                 /* h = 2 */
        v = stage_in_register(v, _mm256_permute2f128_ps(v, v, 0x01), 0xF0);         /* h = 4 */
        _mm256_storeu_ps(z + j, v);
    }
    for (int64_t h = 8; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j += 8) {
                __m256 a = _mm256_loadu_ps(z + j), b = _mm256_loadu_ps(z + j + h);
                _mm256_storeu_ps(z + j, _mm256_add_ps(a, b));
                _mm256_storeu_ps(z + j + h, _mm256_sub_ps(a, b));
            }
}

/* y = H_m^T z per column for one block, n a multiple of 8, m a multiple of 4: 4 output rows x 16
 * columns in registers while p' runs. With s = +-1 the product s * z is exact, so fma(s, z, acc)
 * rounds once exactly where acc + s * z does: the same bits, one instruction. */
static void mix_block_avx2(const float *zc, float *yc, int64_t m, int64_t n, const float *signs, float scale) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t p = 0; p < m; p += 4)
        for (int64_t q = 0; q < n; q += 16) {
            const int two = q + 16 <= n;
            __m256 acc[4][2];
            const __m256 z0a = _mm256_loadu_ps(zc + q), z0b = two ? _mm256_loadu_ps(zc + q + 8) : _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                const __m256 s = _mm256_set1_ps(signs[p + i]);
                acc[i][0] = _mm256_mul_ps(s, z0a); /* exact: +-z */
                acc[i][1] = _mm256_mul_ps(s, z0b);
            }
            for (int64_t pp = 1; pp < m; pp++) {
                const float *zp = zc + pp * n + q;
                const __m256 za = _mm256_loadu_ps(zp), zb = two ? _mm256_loadu_ps(zp + 8) : _mm256_setzero_ps();
                const float *srow = signs + pp * m + p;
                for (int i = 0; i < 4; i++) {
                    const __m256 s = _mm256_set1_ps(srow[i]);
                    acc[i][0] = _mm256_fmadd_ps(s, za, acc[i][0]);
                    acc[i][1] = _mm256_fmadd_ps(s, zb, acc[i][1]);
                }
            }
            for (int i = 0; i < 4; i++) {
                _mm256_storeu_ps(yc + (p + i) * n + q, _mm256_mul_ps(acc[i][0], vscale));
                if (two) _mm256_storeu_ps(yc + (p + i) * n + q + 8, _mm256_mul_ps(acc[i][1], vscale));
            }
        }
}

static void rotate_row(const void *x, int dtype, float *z, float *out, int64_t blocks, int64_t m, int64_t n,
                       const float *signs, float scale) {
    rotate_row_using(x, dtype, z, out, blocks, m, n, signs, scale, 8, butterflies_avx2, mix_block_avx2);
}
