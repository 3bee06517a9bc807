/* The fixed-order lane reduction the row-stable C kernels share (included by each source; its text
 * is part of every kernel's build key in c_build.py). Needs AVX-512F. */
#ifndef QHF_TREE_SUM_H
#define QHF_TREE_SUM_H
#include <immintrin.h>

/* acc[0] + ... + acc[15] by the fixed tree (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1). */
static inline float tree_sum16(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

#endif
