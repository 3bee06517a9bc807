/*
 * Row-stable float linear for CPUs with AVX2 and FMA but no AVX-512: the same entry point and the
 * same bits as rowstable_linear.c (its header states the order; `ops.reference.rowstable_linear_reference`
 * is the oracle): lane r (0..15) adds the products of k = r, r + 16, ... in ascending k, then the
 * 16 lanes are summed by the tree (r, r + 8), (r, r + 4), (r, r + 2), (r, r + 1).
 *
 * bf16 (the lm_head's dtype): one 256-bit load holds weights k0 .. k0 + 15; a shift turns the
 * even k into fp32, a mask the odd k. So accumulator E's lane p holds lane 2p of the order above
 * and O's lane p holds lane 2p + 1; the x rows are staged in the same even-then-odd order. Each
 * lane still adds its own k in ascending order, and every step of the tree pairs lanes of one
 * parity, so the tree runs on E and O apart and adds them last: the same additions, the same bits.
 * A product of two bf16 values is exact in fp32 (barring overflow and subnormal underflow, as in
 * the AVX-512 kernel), so a fused multiply-add gives multiply-then-add's bits at half the
 * instructions. fp32 keeps the natural order, multiply then add (two roundings).
 *
 * Speed: with 16 vector registers a block holds at most 12 accumulators, so up to 6 query rows take
 * one weight row at a time. Threads take chunks of weight rows small enough to stay in L2, and each
 * chunk is passed once per group of query rows whose staged x fits in L1: the weight is read from
 * memory once per call, and the x rows are not re-read from L2 for every weight row. Every element
 * is still computed by one thread alone, in the order above. A block reads its NB rows as NB short
 * streams (1-2 KB each at lm_head widths), too short for the hardware prefetcher, so each chunk
 * step prefetches the same k of the rows PF_ROWS ahead, into L2: into L1, 8 rows ahead, it gave
 * 1.2-1.3x on SmolLM2's and Qwen 0.5B's lm_head on an AVX2 EPYC (Zen 3); into L2, 16 ahead, 1.6x
 * more on a Zen 4 EPYC (benchmarks/lm_head_kernels_epyc_zen4.md). A prefetch changes no arithmetic.
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
#define MB 6 /* query rows per register block at most */
#define L1_X_BYTES (24 * 1024) /* staged x rows one pass keeps in L1 */
#define L2_W_BYTES (128 * 1024) /* weight rows one chunk keeps in L2 across passes */
#define PF_ROWS 16 /* weight rows ahead that each chunk step prefetches, into L2 */
#define UNROLL _Pragma("GCC unroll 8") /* keep the accumulators in registers */

typedef struct {
    const float *xf; /* [M, Kp] fp32, zero padded; bf16: even-then-odd within each 16 */
    int64_t M, K, Kp;
    const void *w;
    int64_t w_stride, N;
    const void *bias;
    void *out;
    int64_t out_stride;
    int dtype;
} Problem;

static inline float scalar(const void *base, int dtype, int64_t i) {
    return dtype == 0 ? ((const float *)base)[i] : bf16_to_f32(((const uint16_t *)base)[i]);
}

static inline void store(const Problem *P, int64_t m, int64_t n, float s) {
    if (P->bias) s = s + scalar(P->bias, P->dtype, n);
    if (P->dtype == 0)
        ((float *)P->out)[m * P->out_stride + n] = s;
    else
        ((uint16_t *)P->out)[m * P->out_stride + n] = f32_to_bf16(s);
}

/* The tree over lanes held as E (lane 2p at p) and O (lane 2p + 1 at p), bf16 layout:
 * (r, r + 8) is (p, p + 4) in each; (r, r + 4) is (q, q + 2); (r, r + 2) is (0, 1); (0, 1) is E + O. */
static inline float tree_sum_parity(__m256 e, __m256 o) {
    __m256 s8 = _mm256_add_ps(_mm256_permute2f128_ps(e, o, 0x20), _mm256_permute2f128_ps(e, o, 0x31)); /* [E' | O'] */
    __m128 se = _mm256_castps256_ps128(s8), so = _mm256_extractf128_ps(s8, 1);
    __m128 s4 = _mm_add_ps(_mm_shuffle_ps(se, so, _MM_SHUFFLE(1, 0, 1, 0)), _mm_shuffle_ps(se, so, _MM_SHUFFLE(3, 2, 3, 2)));
    __m128 s2 = _mm_add_ps(s4, _mm_shuffle_ps(s4, s4, _MM_SHUFFLE(2, 3, 0, 1))); /* [E0+E1, ., O0+O1, .] */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehl_ps(s2, s2)));
}

/* Weights k .. k + 15 of a bf16 row as raw 16-bit pairs, zero padded past `end` (the last chunk). */
static inline __m256i load16_bf16_tail(const uint16_t *row, int64_t k, int64_t end) {
    uint16_t buf[LANES] = {0};
    memcpy(buf, row + k, (size_t)(end - k) * sizeof(uint16_t));
    return _mm256_loadu_si256((const __m256i *)buf);
}

/* One chunk of 16 k for the bf16 block: weight rows as raw pairs -> even/odd fp32 -> FMA per row. */
#define BF16_CHUNK(LOAD_W)                                                                                 \
    UNROLL for (int j = 0; j < nb; ++j) {                                                                  \
        const __m256i raw = LOAD_W;                                                                        \
        const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));                                 \
        const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, odd_mask));                            \
        UNROLL for (int i = 0; i < mb; ++i) {                                                              \
            e[j][i] = _mm256_fmadd_ps(_mm256_load_ps(xr[i] + k), we, e[j][i]);                             \
            o[j][i] = _mm256_fmadd_ps(_mm256_load_ps(xr[i] + k + 8), wo, o[j][i]);                         \
        }                                                                                                  \
    }

/* bf16: output rows m0 .. m0 + mb against weight rows n0 .. n0 + nb (constants after inlining). */
static inline __attribute__((always_inline)) void block_bf16(const Problem *P, int64_t n0, const int nb, int64_t m0,
                                                             const int mb) {
    const __m256i odd_mask = _mm256_set1_epi32((int)0xFFFF0000u);
    const uint16_t *wr[NB];
    const float *xr[MB];
    __m256 e[NB][MB], o[NB][MB];
    UNROLL for (int j = 0; j < nb; ++j) wr[j] = (const uint16_t *)P->w + (n0 + j) * P->w_stride;
    UNROLL for (int i = 0; i < mb; ++i) xr[i] = P->xf + (m0 + i) * P->Kp;
    UNROLL for (int j = 0; j < nb; ++j)
        UNROLL for (int i = 0; i < mb; ++i) e[j][i] = o[j][i] = _mm256_setzero_ps();
    const int64_t full = P->K / LANES * LANES;
    int64_t k = 0;
    const int64_t ahead = PF_ROWS * P->w_stride; /* elements */
    for (; k < full; k += LANES) {
        UNROLL for (int j = 0; j < nb; ++j) _mm_prefetch((const char *)(wr[j] + k + ahead), _MM_HINT_T1);
        BF16_CHUNK(_mm256_loadu_si256((const __m256i *)(wr[j] + k)))
    }
    if (k < P->Kp) { BF16_CHUNK(load16_bf16_tail(wr[j], k, P->K)) }
    UNROLL for (int j = 0; j < nb; ++j)
        UNROLL for (int i = 0; i < mb; ++i) store(P, m0 + i, n0 + j, tree_sum_parity(e[j][i], o[j][i]));
}

/* Elements i .. i + 7 of an fp32 row, zero padded past `end` (the last chunk). */
static inline __m256 load8_f32_tail(const float *row, int64_t i, int64_t end) {
    float buf[8] = {0};
    for (int64_t j = i; j < end && j < i + 8; ++j) buf[j - i] = row[j];
    return _mm256_loadu_ps(buf);
}

#define F32_CHUNK(LOAD_LO, LOAD_HI)                                                                        \
    UNROLL for (int j = 0; j < nb; ++j) {                                                                  \
        const __m256 wl = LOAD_LO, wh = LOAD_HI;                                                           \
        UNROLL for (int i = 0; i < mb; ++i) {                                                              \
            lo[j][i] = _mm256_add_ps(lo[j][i], _mm256_mul_ps(_mm256_load_ps(xr[i] + k), wl));              \
            hi[j][i] = _mm256_add_ps(hi[j][i], _mm256_mul_ps(_mm256_load_ps(xr[i] + k + 8), wh));          \
        }                                                                                                  \
    }

/* fp32: the same block, natural lane order, multiply then add. */
static inline __attribute__((always_inline)) void block_f32(const Problem *P, int64_t n0, const int nb, int64_t m0,
                                                            const int mb) {
    const float *wr[NB];
    const float *xr[MB];
    __m256 lo[NB][MB], hi[NB][MB];
    UNROLL for (int j = 0; j < nb; ++j) wr[j] = (const float *)P->w + (n0 + j) * P->w_stride;
    UNROLL for (int i = 0; i < mb; ++i) xr[i] = P->xf + (m0 + i) * P->Kp;
    UNROLL for (int j = 0; j < nb; ++j)
        UNROLL for (int i = 0; i < mb; ++i) lo[j][i] = hi[j][i] = _mm256_setzero_ps();
    const int64_t full = P->K / LANES * LANES;
    int64_t k = 0;
    const int64_t ahead = PF_ROWS * P->w_stride; /* elements */
    for (; k < full; k += LANES) {
        UNROLL for (int j = 0; j < nb; ++j) _mm_prefetch((const char *)(wr[j] + k + ahead), _MM_HINT_T1);
        F32_CHUNK(_mm256_loadu_ps(wr[j] + k), _mm256_loadu_ps(wr[j] + k + 8))
    }
    if (k < P->Kp) { F32_CHUNK(load8_f32_tail(wr[j], k, P->K), load8_f32_tail(wr[j], k + 8, P->K)) }
    UNROLL for (int j = 0; j < nb; ++j)
        UNROLL for (int i = 0; i < mb; ++i) store(P, m0 + i, n0 + j, tree_sum_halves(lo[j][i], hi[j][i]));
}

/* One register block: nb x mb output elements, each with its own accumulators. */
static inline __attribute__((always_inline)) void block(const Problem *P, int64_t n0, const int nb, int64_t m0, const int mb) {
    if (P->dtype == 1)
        block_bf16(P, n0, nb, m0, mb);
    else
        block_f32(P, n0, nb, m0, mb);
}

/* Query rows m0 .. m0 + mb (1 <= mb <= MB) against weight rows n0 .. n0 + nb (NB or 1): one row takes
 * NB weight rows at once (streams in flight), up to 3 rows take 2 x mb blocks, more take 1 x mb. */
static void pass(const Problem *P, int64_t n0, int nb, int64_t m0, int mb) {
#define ROWS(N0, NBV)                                                                              \
    switch (mb) {                                                                                  \
    case 1: block(P, N0, NBV, m0, 1); break;                                                       \
    case 2: block(P, N0, NBV, m0, 2); break;                                                       \
    case 3: block(P, N0, NBV, m0, 3); break;                                                       \
    case 4: block(P, N0, NBV, m0, 4); break;                                                       \
    case 5: block(P, N0, NBV, m0, 5); break;                                                       \
    default: block(P, N0, NBV, m0, 6); break;                                                      \
    }
    if (nb == NB && mb == 1) {
        block(P, n0, NB, m0, 1);
    } else if (nb == NB && mb <= 3) {
        ROWS(n0, 2)
        ROWS(n0 + 2, 2)
    } else if (nb == NB) {
        for (int j = 0; j < NB; ++j) ROWS(n0 + j, 1)
    } else {
        ROWS(n0, 1)
    }
#undef ROWS
}

/* Weight rows n0 .. n1 (a chunk that stays in L2) against every query row, `group` rows per pass
 * (their staged x stays in L1). */
static void chunk(const Problem *P, int64_t n0, int64_t n1, int group) {
    for (int64_t m0 = 0; m0 < P->M; m0 += group) {
        const int mb = P->M - m0 < group ? (int)(P->M - m0) : group;
        int64_t n = n0;
        for (; n + NB <= n1; n += NB) pass(P, n, NB, m0, mb);
        for (; n < n1; ++n) pass(P, n, 1, m0, mb);
    }
}

/* Row m of x as fp32 into xf (Kp floats, zero padded); bf16 rows even-then-odd within each 16. */
static void stage_row(const void *x, int64_t offset, int64_t K, int64_t Kp, int dtype, float *xf) {
    for (int64_t k = 0; k < Kp; ++k) {
        int64_t src = k;
        if (dtype == 1) {
            const int64_t base = k / LANES * LANES, p = k - base;
            src = base + (p < 8 ? 2 * p : 2 * (p - 8) + 1);
        }
        xf[k] = src < K ? scalar(x, dtype, offset + src) : 0.0f;
    }
}

int qhf_rowstable_linear(const void *x, int64_t x_stride, int64_t M, int64_t K, const void *w, int64_t w_stride,
                         int64_t N, const void *bias, void *out, int64_t out_stride, int dtype, int n_threads) {
    if ((dtype != 0 && dtype != 1) || M < 0 || K <= 0 || N < 0) return 2;
    const int64_t Kp = (K + LANES - 1) / LANES * LANES;
    float *xf = (float *)aligned_alloc(64, (size_t)(M * Kp) * sizeof(float) + 64); /* a multiple of 64 */
    if (!xf) return 1;
    for (int64_t m = 0; m < M; ++m) stage_row(x, m * x_stride, K, Kp, dtype, xf + m * Kp);
    const Problem P = {xf, M, K, Kp, w, w_stride, N, bias, out, out_stride, dtype};
    const int64_t fit = L1_X_BYTES / (Kp * (int64_t)sizeof(float));
    const int group = fit < 1 ? 1 : fit > MB ? MB : (int)fit;
    const int64_t rows = L2_W_BYTES / (K * (dtype == 0 ? 4 : 2)) / NB * NB;
    const int64_t chunk_rows = rows < NB ? NB : rows;
    const int64_t chunks = (N + chunk_rows - 1) / chunk_rows;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1)
    for (int64_t c = 0; c < chunks; ++c) chunk(&P, c * chunk_rows, c * chunk_rows + chunk_rows < N ? c * chunk_rows + chunk_rows : N, group);
    free(xf);
    return 0;
}
