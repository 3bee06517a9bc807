/* Helpers the C kernels share: scalar bf16 <-> fp32 and the fixed-order lane reduction (AVX2, AVX-512F).
 * Included by each source; its text is part of every kernel's build key in c_build.py. */
#ifndef QHF_COMMON_H
#define QHF_COMMON_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16, round to nearest even; NaN stays a quiet NaN (as c10::BFloat16). A select, not a
 * branch, so loops over it vectorize. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : rounded); /* quiet NaN */
}

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>

/* The same tree over 16 lanes held as lo = lanes 0..7, hi = 8..15 (the AVX2 builds' layout). */
static inline float tree_sum_halves(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}
#endif

#ifdef __AVX512F__

/* acc[0] + ... + acc[15] by the fixed tree (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1). */
static inline float tree_sum16(__m512 v) {
    return tree_sum_halves(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif

#endif
