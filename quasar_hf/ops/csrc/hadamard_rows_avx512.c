/*
 * AVX-512F build of csrc/hadamard_rows.c: the same rotation with the same bits (each element's fp32
 * operations and their order are those of hadamard_rows.c and `rotate_rows_reference`), 16 floats
 * per register instead of the AVX2 build's 8:
 *   - butterflies h = 1, 2, 4, 8 inside each register by lane permutes (a + b, a - b), then h >= 16
 *     on whole registers;
 *   - the +-1 mix as fma(s, z, acc), bitwise acc + s * z (s * z = +-z is exact), for 4 output rows x up
 *     to 64 columns held in 16 registers;
 *   - one multiplication by `scale`.
 * Sylvester blocks of fewer than 16 floats take the portable loops.
 */
#include <immintrin.h>
#include "hadamard_rows.h"

/* One butterfly stage of span h < 16 inside a register: lanes with bit h set (mask) get a - b, the
 * others a + b (a the lane with the bit clear, b its partner). */
static inline __m512 stage_in_register(__m512 v, __m512 partner, __mmask16 upper) {
    const __m512 sum = _mm512_add_ps(v, partner);  /* lower lanes: a + b (b + a is the same bits) */
    const __m512 diff = _mm512_sub_ps(partner, v); /* upper lanes: partner = a, v = b: a - b */
    return _mm512_mask_blend_ps(upper, sum, diff);
}

static void butterflies_avx512(float *z, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) {
        __m512 v = _mm512_loadu_ps(z + j);
        v = stage_in_register(v, _mm512_permute_ps(v, 0xB1), 0xAAAA);          /* h = 1: swap neighbours */
        v = stage_in_register(v, _mm512_permute_ps(v, 0x4E), 0xCCCC);          /* h = 2: swap pairs */
        v = stage_in_register(v, _mm512_shuffle_f32x4(v, v, 0xB1), 0xF0F0);    /* h = 4: swap 128-bit lanes */
        v = stage_in_register(v, _mm512_shuffle_f32x4(v, v, 0x4E), 0xFF00);    /* h = 8: swap 256-bit halves */
        _mm512_storeu_ps(z + j, v);
    }
    for (int64_t h = 16; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j += 16) {
                const __m512 a = _mm512_loadu_ps(z + j), b = _mm512_loadu_ps(z + j + h);
                _mm512_storeu_ps(z + j, _mm512_add_ps(a, b));
                _mm512_storeu_ps(z + j + h, _mm512_sub_ps(a, b));
            }
}

/* y = H_m^T z per column for one block, n a multiple of 16, m a multiple of 4: 4 output rows x C
 * registers of 16 columns (C <= 4) accumulate while p' runs; every column's sum is its own. With
 * s = +-1 the product s * z is exact, so fma(s, z, acc) rounds once exactly where acc + s * z does:
 * the same bits, one instruction. */
static inline __attribute__((always_inline)) void mix_columns(const float *zc, float *yc, int64_t m, int64_t n,
                                                              const float *signs, __m512 vscale, int64_t p, int64_t q,
                                                              const int C) {
    __m512 acc[4][4];
    for (int c = 0; c < C; c++) {
        const __m512 z0 = _mm512_loadu_ps(zc + q + 16 * c);
        for (int i = 0; i < 4; i++) acc[i][c] = _mm512_mul_ps(_mm512_set1_ps(signs[p + i]), z0); /* exact: +-z */
    }
    for (int64_t pp = 1; pp < m; pp++) {
        const float *srow = signs + pp * m + p;
        __m512 s[4];
        for (int i = 0; i < 4; i++) s[i] = _mm512_set1_ps(srow[i]);
        for (int c = 0; c < C; c++) {
            const __m512 z = _mm512_loadu_ps(zc + pp * n + q + 16 * c);
            for (int i = 0; i < 4; i++) acc[i][c] = _mm512_fmadd_ps(s[i], z, acc[i][c]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(yc + (p + i) * n + q + 16 * c, _mm512_mul_ps(acc[i][c], vscale));
}

static void mix_block_avx512(const float *zc, float *yc, int64_t m, int64_t n, const float *signs, float scale) {
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t p = 0; p < m; p += 4)
        for (int64_t q = 0; q < n; q += 64) {
            switch ((n - q) / 16) {
            case 1: mix_columns(zc, yc, m, n, signs, vscale, p, q, 1); break;
            case 2: mix_columns(zc, yc, m, n, signs, vscale, p, q, 2); break;
            case 3: mix_columns(zc, yc, m, n, signs, vscale, p, q, 3); break;
            default: mix_columns(zc, yc, m, n, signs, vscale, p, q, 4); break;
            }
        }
}

static void rotate_row(const void *x, int dtype, float *z, float *out, int64_t blocks, int64_t m, int64_t n,
                       const float *signs, float scale) {
    rotate_row_using(x, dtype, z, out, blocks, m, n, signs, scale, 16, butterflies_avx512, mix_block_avx512);
}
