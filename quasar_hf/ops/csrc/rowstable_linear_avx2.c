/*
 * Row-stable float linear for CPUs with AVX2 but no AVX-512: the same entry point and the same
 * bits as rowstable_linear.c (its header states the order; `ops.reference.rowstable_linear_reference`
 * is the oracle). The 16 lanes are kept as two 8-lane halves, lane l still adding the products of
 * k = l, l + 16, ... in ascending k, multiply then add, and the halves are summed by the same tree.
 * Products are always multiply-then-add here; for bf16 the AVX-512 kernel's fused multiply-add
 * gives the same bits because a product of two bf16 values is exact in fp32.
 */
#include <immintrin.h>
#include "qhf_common.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define NB 4 /* weight rows per block; a register block is 2 rows x 2 weight rows or 1 row x 4 weight rows */
#define UNROLL _Pragma("GCC unroll 8") /* keep the accumulators in registers */
#define MB 2 /* query rows per block: 8 accumulator halves either way, so 8 addition chains overlap */

/* Elements i .. i + 7 (fewer at the end of the row, zero padded) of a float32/bf16 row -> fp32. */
static inline __m256 load8(const void *base, int dtype, int64_t i, int64_t end) {
    if (end - i >= 8) {
        if (dtype == 0) return _mm256_loadu_ps((const float *)base + i);
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    float buf[8] = {0};
    for (int64_t j = i; j < end; ++j)
        buf[j - i] = dtype == 0 ? ((const float *)base)[j] : bf16_to_f32(((const uint16_t *)base)[j]);
    return _mm256_loadu_ps(buf);
}

static inline float scalar(const void *base, int dtype, int64_t i) {
    return dtype == 0 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

/* tree_sum16 of lanes lo = 0..7, hi = 8..15: (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1). */
static inline float tree_sum_halves(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(lo, hi);
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

typedef struct {
    const float *xf; /* [M, Kp] fp32, zero padded */
    int64_t M, K, Kp;
    const void *w;
    int64_t w_stride, N;
    const void *bias;
    void *out;
    int64_t out_stride;
    int dtype;
} Problem;

static inline void store(const Problem *P, int64_t m, int64_t n, float s) {
    if (P->bias) s = s + scalar(P->bias, P->dtype, n);
    if (P->dtype == 0)
        ((float *)P->out)[m * P->out_stride + n] = s;
    else
        ((uint16_t *)P->out)[m * P->out_stride + n] = f32_to_bf16(s);
}

/* Output rows m0 .. m0 + mb, features n0 .. n0 + nb (constants after inlining). */
static inline __attribute__((always_inline)) void block(const Problem *P, int64_t n0, const int nb, int64_t m0, const int mb) {
    __m256 lo[NB][MB], hi[NB][MB];
    UNROLL for (int j = 0; j < nb; ++j)
        UNROLL for (int i = 0; i < mb; ++i) lo[j][i] = hi[j][i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < P->Kp; k += LANES) {
        __m256 wl[NB], wh[NB];
        UNROLL for (int j = 0; j < nb; ++j) {
            const char *row = (const char *)P->w + (n0 + j) * P->w_stride * (P->dtype == 0 ? 4 : 2);
            wl[j] = load8(row, P->dtype, k, P->K);
            wh[j] = load8(row, P->dtype, k + 8, P->K);
        }
        UNROLL for (int i = 0; i < mb; ++i) {
            const __m256 xl = _mm256_loadu_ps(P->xf + (m0 + i) * P->Kp + k);
            const __m256 xh = _mm256_loadu_ps(P->xf + (m0 + i) * P->Kp + k + 8);
            UNROLL for (int j = 0; j < nb; ++j) {
                lo[j][i] = _mm256_add_ps(lo[j][i], _mm256_mul_ps(xl, wl[j]));
                hi[j][i] = _mm256_add_ps(hi[j][i], _mm256_mul_ps(xh, wh[j]));
            }
        }
    }
    UNROLL for (int j = 0; j < nb; ++j)
        UNROLL for (int i = 0; i < mb; ++i) store(P, m0 + i, n0 + j, tree_sum_halves(lo[j][i], hi[j][i]));
}

/* Every query row against weight rows n0 .. n0 + nb (nb = NB, or 1 for the last few). */
static void features(const Problem *P, int64_t n0, int nb) {
    for (int64_t m0 = 0; m0 < P->M; m0 += MB) {
        const int pair = P->M - m0 >= MB;
        if (nb == NB && pair) {
            block(P, n0, 2, m0, MB);
            block(P, n0 + 2, 2, m0, MB);
        } else if (nb == NB) {
            block(P, n0, NB, m0, 1);
        } else if (pair) {
            block(P, n0, 1, m0, MB);
        } else {
            block(P, n0, 1, m0, 1);
        }
    }
}

int qhf_rowstable_linear(const void *x, int64_t x_stride, int64_t M, int64_t K, const void *w, int64_t w_stride,
                         int64_t N, const void *bias, void *out, int64_t out_stride, int dtype, int n_threads) {
    if ((dtype != 0 && dtype != 1) || M < 0 || K <= 0 || N < 0) return 2;
    const int64_t Kp = (K + LANES - 1) / LANES * LANES;
    float *xf = (float *)aligned_alloc(64, (size_t)(M * Kp > 0 ? M * Kp : 1) * sizeof(float) + 64);
    if (!xf) return 1;
    for (int64_t m = 0; m < M; ++m) {
        for (int64_t k = 0; k < K; ++k) xf[m * Kp + k] = scalar(x, dtype, m * x_stride + k);
        for (int64_t k = K; k < Kp; ++k) xf[m * Kp + k] = 0.0f;
    }
    const Problem P = {xf, M, K, Kp, w, w_stride, N, bias, out, out_stride, dtype};
    const int64_t full_blocks = N / NB;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int64_t b = 0; b < full_blocks; ++b) features(&P, b * NB, NB);
    for (int64_t n = full_blocks * NB; n < N; ++n) features(&P, n, 1);
    free(xf);
    return 0;
}
