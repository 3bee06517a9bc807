/*
 * Row-stable float linear for few rows (the lm_head of decode and verification steps):
 *   out[m, n] = sum_k x[m, k] * w[n, k]  (+ bias[n])
 *
 * Every output element is computed alone, in an order that depends on K only:
 *   lane l (0..15) adds the products of k = l, l + 16, l + 32, ... in ascending k, in fp32,
 *   multiply then add (never fused); the 16 lanes are summed by the fixed tree (l, l + 8),
 *   (l, l + 4), (l, l + 2), (l, l + 1); then bias[n] is added; the result is rounded to the
 *   output dtype (bf16: nearest even).
 * So row m's output does not depend on how many rows are in the call, on the other rows, or on
 * the thread count: a one-token decode step and a k-token verification give the same logits.
 * The plain-PyTorch oracle is `ops.reference.rowstable_linear_reference`.
 *
 * Speed: each weight row is read once per call for up to MB query rows (more rows re-read it from
 * L1), and NB weight rows are in flight at once so the per-lane addition chains overlap. Threads
 * split the output features, so every element is still computed by one thread alone. The NB rows
 * are NB short streams (1-4 KB at lm_head widths), too short for the hardware prefetcher: each step
 * prefetches the same k of the rows PF_ROWS ahead into L2, which took SmolLM2's lm_head from 12.7 to
 * 27.2 GB/s on a 2-core AMD EPYC Zen 4 (benchmarks/lm_head_kernels_epyc_zen4.md). A prefetch changes no arithmetic.
 *
 * dtypes (x, w, bias, out share one): 0 = float32, 1 = bfloat16.
 */
#include <immintrin.h>
#include "qhf_common.h"
#include "qhf_entry_points.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define NB 4 /* weight rows per block */
#define MB 6 /* query rows per block */
#define PF_ROWS 16 /* weight rows ahead that each step prefetches, into L2 */

static inline __m512 load16(const void *base, int dtype, int64_t offset, __mmask16 mask) {
    if (dtype == 0) return _mm512_maskz_loadu_ps(mask, (const float *)base + offset);
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)base + offset);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline float scalar(const void *base, int dtype, int64_t i) {
    return dtype == 0 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
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

/* Output rows m0 .. m0 + mb, features n0 .. n0 + nb. Inlined with constant nb and mb, so the
 * accumulators stay in registers. A product of two bf16 values is exact in fp32, so for bf16 a fused
 * multiply-add gives the bits of multiply-then-add at half the instructions; fp32 keeps two roundings. */
static inline __attribute__((always_inline)) void block(const Problem *P, int64_t n0, const int nb, int64_t m0,
                                                        const int mb, const int exact_products) {
    __m512 acc[NB][MB];
    _Pragma("GCC unroll 8")
    for (int j = 0; j < nb; ++j)
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mb; ++i) acc[j][i] = _mm512_setzero_ps();
    const int64_t elem = P->dtype == 0 ? 4 : 2, ahead = PF_ROWS * P->w_stride * elem; /* bytes */
    for (int64_t k = 0; k < P->Kp; k += LANES) {
        _Pragma("GCC unroll 8")
        for (int j = 0; j < nb; ++j)  /* a prefetch past the weight's end is harmless: it never faults */
            _mm_prefetch((const char *)P->w + ((n0 + j) * P->w_stride + k) * elem + ahead, _MM_HINT_T1);
        const int64_t left = P->K - k;
        const __mmask16 mask = left >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        __m512 wv[NB];
        _Pragma("GCC unroll 8")
        for (int j = 0; j < nb; ++j) wv[j] = load16(P->w, P->dtype, (n0 + j) * P->w_stride + k, mask);
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mb; ++i) {
            const __m512 xv = _mm512_loadu_ps(P->xf + (m0 + i) * P->Kp + k);
            _Pragma("GCC unroll 8")
            for (int j = 0; j < nb; ++j)
                acc[j][i] = exact_products ? _mm512_fmadd_ps(xv, wv[j], acc[j][i])
                                           : _mm512_add_ps(acc[j][i], _mm512_mul_ps(xv, wv[j]));
        }
    }
    _Pragma("GCC unroll 8")
    for (int j = 0; j < nb; ++j)
        _Pragma("GCC unroll 8")
        for (int i = 0; i < mb; ++i) store(P, m0 + i, n0 + j, tree_sum16(acc[j][i]));
}

#define ROWS_SWITCH(NBV, EXACT)                                                                    \
    switch (mb) {                                                                                  \
    case 1: block(P, n0, NBV, m0, 1, EXACT); break;                                                \
    case 2: block(P, n0, NBV, m0, 2, EXACT); break;                                                \
    case 3: block(P, n0, NBV, m0, 3, EXACT); break;                                                \
    case 4: block(P, n0, NBV, m0, 4, EXACT); break;                                                \
    case 5: block(P, n0, NBV, m0, 5, EXACT); break;                                                \
    default: block(P, n0, NBV, m0, 6, EXACT); break;                                               \
    }

/* Every query row against weight rows n0 .. n0 + nb (nb = NB, or 1 for the last few). */
static void features(const Problem *P, int64_t n0, int nb) {
    for (int64_t m0 = 0; m0 < P->M; m0 += MB) {
        const int mb = P->M - m0 < MB ? (int)(P->M - m0) : MB;
        if (nb == NB && P->dtype == 1) {
            ROWS_SWITCH(NB, 1)
        } else if (nb == NB) {
            ROWS_SWITCH(NB, 0)
        } else {
            ROWS_SWITCH(1, P->dtype == 1)
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
