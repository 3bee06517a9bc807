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

/* tree_sum_halves of 8 keys at once: s8[t] = lo_t + hi_t (the tree's first step, taken by the caller);
 * lane t of the result is tree_sum_halves(lo_t, hi_t), the same additions of the same operands. */
static inline __m256 tree_sum_halves_x8(const __m256 *s8) {
    __m256 s4[4]; /* s4[u] half h: the (l, l + 4) sums of key 2u + h */
    for (int u = 0; u < 4; ++u)
        s4[u] = _mm256_add_ps(_mm256_permute2f128_ps(s8[2 * u], s8[2 * u + 1], 0x20),
                              _mm256_permute2f128_ps(s8[2 * u], s8[2 * u + 1], 0x31));
    /* s2[w] half h: the (l, l + 2) sums of keys 4w + h and 4w + 2 + h */
    const __m256 s2_0 = _mm256_add_ps(_mm256_shuffle_ps(s4[0], s4[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm256_shuffle_ps(s4[0], s4[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 s2_1 = _mm256_add_ps(_mm256_shuffle_ps(s4[2], s4[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm256_shuffle_ps(s4[2], s4[3], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 s1 = _mm256_add_ps(_mm256_shuffle_ps(s2_0, s2_1, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(s2_0, s2_1, _MM_SHUFFLE(3, 1, 3, 1))); /* lane 4h + j: key 2j + h */
    return _mm256_permutevar8x32_ps(s1, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#endif

#ifdef __AVX512F__

/* acc[0] + ... + acc[15] by the fixed tree (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1). */
static inline float tree_sum16(__m512 v) {
    return tree_sum_halves(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

/* tree_sum16 of 16 vectors at once, in two parts so that a caller holds half as many: tree16_pair(a, b)
 * is the tree's first step of a (lanes 0..7) and b (8..15); tree16_x16 takes p[u] = tree16_pair(v[2u],
 * v[2u + 1]) and returns lane t = tree_sum16(v[t]), the same additions of the same operands. */
static inline __m512 tree16_pair(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}

static inline __m512 tree16_x16(const __m512 *p) {
    __m512 s4[4]; /* s4[u] quarter j: the (l, l + 4) sums of key 4u + j */
    for (int u = 0; u < 4; ++u)
        s4[u] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * u], p[2 * u + 1], 0x88),
                              _mm512_shuffle_f32x4(p[2 * u], p[2 * u + 1], 0xDD));
    /* s2[w] quarter j: the (l, l + 2) sums of keys 8w + j and 8w + 4 + j */
    const __m512 s2_0 = _mm512_add_ps(_mm512_shuffle_ps(s4[0], s4[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(s4[0], s4[1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 s2_1 = _mm512_add_ps(_mm512_shuffle_ps(s4[2], s4[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(s4[2], s4[3], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 s1 = _mm512_add_ps(_mm512_shuffle_ps(s2_0, s2_1, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(s2_0, s2_1, _MM_SHUFFLE(3, 1, 3, 1))); /* lane 4j + i: key 4i + j */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s1);
}
#endif

#endif
