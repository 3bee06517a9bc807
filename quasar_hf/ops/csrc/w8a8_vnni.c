/* Fused W8A8 linear for x86-64 CPUs with AVX-512 VNNI (quasar_hf.ops.cpu_fused).
 *
 * One call does: per-token INT8 quantization of x [M, K] -> int8 GEMM against pre-packed int8
 * weights (each weight byte read from memory once for all rows of a block) -> dequantizing
 * epilogue (+ bias) -> output in x's dtype. Numerics are those of quasar_hf/ops/reference.py,
 * bit for bit: build WITHOUT -ffast-math and WITH -ffp-contract=off (no FMA contraction).
 *
 * Weight layout (made by cpu_fused.pack_weight): int8 [Np/16][Kp/4][16][4], Np = N rounded up
 * to 16, Kp = K rounded up to 4, zero padded. One 64-byte row of it = 4 consecutive k of 16
 * output channels, the operand of one _mm512_dpbusd_epi32.
 * dpbusd multiplies UNSIGNED by signed bytes, so activations are stored as q + 128 (uint8) and
 * the exact correction 128 * sum_k W[n, k] (wsum128[n], computed at pack time) is subtracted.
 * int32 arithmetic wraps (dpbusd does not saturate), so acc - wsum128 equals the exact dot product
 * modulo 2^32: exact whenever the true result fits int32 (|acc| <= 127 * 127 * K: K < 133,000).
 * The micro-kernel reads NB_MAX streams of Kp * 16 bytes at once and prefetches each PF_BYTES ahead
 * into L2 (5-20 % at M = 1 on a Zen 4 EPYC, a probe noted in `git show 9994225:benchmarks/README.md`); a prefetch changes no arithmetic.
 */
#include <immintrin.h>
#include <math.h>
#include "qhf_common.h"
#include "qhf_entry_points.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
/* Register block: MB_MAX x NB_MAX = 24 accumulators + 4 weight vectors + 1 broadcast (of 32 zmm).
 * Measured 4x4, 6x4, 8x3, 8x2 at K = N = 4096: 6x4 was fastest at M = 6..16, equal at M = 1. */
#define MB_MAX 6 /* rows per register block */
#define NB_MAX 4 /* 16-channel blocks per register block */
#define UNROLL _Pragma("GCC unroll 6") /* keep the MB x NB accumulators in registers */
#define PF_BYTES 1024 /* how far ahead of its loads the micro-kernel prefetches packed weights, into L2 */

/* ---- dtype conversion --------------------------------------------------------------------- */

/* 16 elements of a bf16/fp16/fp32 array starting at index i -> fp32 (exact); masked lanes = 0. */
static inline __m512 load16_f32(const void *p, int dtype, int64_t i, __mmask16 mask) {
    if (dtype == DT_F32) return _mm512_maskz_loadu_ps(mask, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(mask, (const uint16_t *)p + i);
    if (dtype == DT_BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

/* fp32 -> bf16 with round-to-nearest-even, denormals kept, NaN -> 0x7fc0 (as c10::BFloat16). */
static inline __m256i f32x16_to_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 is_nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, is_nan, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);
}

static inline void store16(void *p, int dtype, int64_t i, __m512 v, __mmask16 mask) {
    if (dtype == DT_F32) _mm512_mask_storeu_ps((float *)p + i, mask, v);
    else if (dtype == DT_BF16) _mm256_mask_storeu_epi16((uint16_t *)p + i, mask, f32x16_to_bf16(v));
    else _mm256_mask_storeu_epi16((uint16_t *)p + i, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1u);
}

/* ---- per-token quantization ---------------------------------------------------------------- */

/* x row (times prescale, if any) element i..i+15 in fp32, exactly as the reference computes it. */
static inline __m512 row16(const void *x, int dtype, const float *prescale, int64_t i, __mmask16 m) {
    __m512 v = load16_f32(x, dtype, i, m);
    if (prescale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, prescale + i));
    return v;
}

/* RMSNorm's per-row factor 1 / sqrt(mean(x^2) + eps) in fp32: squares summed in 16 lanes over k
 * ascending (mul, then add: no FMA), lanes by tree_sum16 (rms_factor_reference is the oracle). */
static float rms_factor(const void *x, int dtype, int64_t K, float eps) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m512 v = load16_f32(x, dtype, k, tail_mask(K - k));
        acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    return 1.0f / sqrtf(tree_sum16(acc) / (float)K + eps);
}

/* One row: aq[0:Kp] = q + 128 (uint8), returns the epilogue scale (amax / 127, NaN if non-finite).
 * q = clamp(floor(x * ((1 / amax) * 127) + 0.5), -127, 127); torch computes 127 / t as
 * reciprocal(t) * 127, so the same two roundings are used here.
 * norm_eps >= 0 folds an RMSNorm in: per-token quantization ignores a row's scale factor, so the
 * row is quantized un-normalized (prescale = the norm's weight) and the epilogue scale carries
 * rms_factor; a zero row keeps scale 0. */
static float quantize_row(const void *x, int dtype, const float *prescale, int64_t K, int64_t Kp, uint8_t *aq,
                          float norm_eps) {
    const float r = norm_eps >= 0.0f ? rms_factor(x, dtype, K, norm_eps) : 1.0f;
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 nonfinite = 0;
    const __m512i abs_bits = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 m = tail_mask(K - k);
        __m512i a = _mm512_and_si512(_mm512_castps_si512(row16(x, dtype, prescale, k, m)), abs_bits);
        nonfinite |= _mm512_cmpge_epi32_mask(a, inf_bits);
        vmax = _mm512_max_ps(vmax, _mm512_castsi512_ps(a));
    }
    float amax = _mm512_reduce_max_ps(vmax);
    if (nonfinite || amax == 0.0f) {
        memset(aq, 128, (size_t)Kp);
        return nonfinite ? __builtin_nanf("") : 0.0f;
    }
    const __m512 inv = _mm512_set1_ps((1.0f / amax) * 127.0f);
    const __m512 half = _mm512_set1_ps(0.5f), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i shift = _mm512_set1_epi32(128);
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 m = tail_mask(K - k);
        __m512 v = _mm512_add_ps(_mm512_mul_ps(row16(x, dtype, prescale, k, m), inv), half);
        v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        /* subnormal amax: 1 / amax = inf and 0 * inf = NaN, which torch's int8 cast turns into 0 */
        v = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        __m512i q = _mm512_add_epi32(_mm512_cvtps_epi32(v), shift);
        _mm_mask_storeu_epi8(aq + k, m, _mm512_cvtepi32_epi8(q));
    }
    for (int64_t k = K; k < Kp; ++k) aq[k] = 128;
    return norm_eps >= 0.0f ? (amax / 127.0f) * r : amax / 127.0f;
}

/* ---- GEMM micro-kernel with fused epilogue ------------------------------------------------- */

typedef uint8_t act_t; /* q + 128 */

#include "w8a8_gemm_args.h"

/* acc[i][j] (row m0+i, channels 16*(nb0+j)..+15) -> exact int32 -> epilogue -> stores. */
static inline void epilogue(const gemm_args *g, int64_t m, int64_t n, __m512i acc) {
    __mmask16 mask = tail_mask(g->N - n);
    acc = _mm512_sub_epi32(acc, _mm512_loadu_si512(g->wsum128 + n));
    if (g->acc_out) _mm512_mask_storeu_epi32(g->acc_out + m * g->N + n, mask, acc);
    if (!g->out) return;
    __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(g->a_scale[m]));
    y = _mm512_mul_ps(y, _mm512_maskz_loadu_ps(mask, g->w_scale + n));
    if (g->bias) y = _mm512_add_ps(y, load16_f32(g->bias, g->bias_dtype, n, mask));
    store16(g->out, g->out_dtype, m * g->out_stride + n, y, mask);
}

/* acc += dot4(a_u8, w_s8) per int32 lane. Inline asm because GCC 12 copies every accumulator
 * through extra registers (and the stack) around _mm512_dpbusd_epi32 in an unrolled loop. */
static inline __attribute__((always_inline)) void dpbusd(__m512i *acc, __m512i a_u8, __m512i w_s8) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(*acc) : "v"(a_u8), "v"(w_s8));
}

/* MB rows x NB channel blocks: MB*NB zmm accumulators, NB weight loads + MB broadcasts per k/4. */
static inline __attribute__((always_inline)) void
micro_kernel(const gemm_args *g, int64_t m0, int64_t nb0, const int MB, const int NB) {
    __m512i acc[MB_MAX][NB_MAX];
    UNROLL for (int i = 0; i < MB; ++i)
        UNROLL for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
    const int64_t kgroups = g->Kp / 4, block_bytes = g->Kp * 16;
    const int8_t *w = g->w + nb0 * block_bytes;
    const uint8_t *a = g->aq + m0 * g->Kp;
    for (int64_t kg = 0; kg < kgroups; ++kg) {
        __m512i wv[NB_MAX];
        UNROLL for (int j = 0; j < NB; ++j) _mm_prefetch((const char *)(w + j * block_bytes + kg * 64 + PF_BYTES), _MM_HINT_T1);
        UNROLL for (int j = 0; j < NB; ++j) wv[j] = _mm512_loadu_si512(w + j * block_bytes + kg * 64);
        UNROLL for (int i = 0; i < MB; ++i) {
            int32_t a4;
            memcpy(&a4, a + i * g->Kp + kg * 4, 4);
            const __m512i av = _mm512_set1_epi32(a4);
            UNROLL for (int j = 0; j < NB; ++j) dpbusd(&acc[i][j], av, wv[j]);
        }
    }
    UNROLL for (int i = 0; i < MB; ++i)
        UNROLL for (int j = 0; j < NB; ++j) epilogue(g, m0 + i, (nb0 + j) * 16, acc[i][j]);
}

#define KERNEL(MB, NB) \
    static void kernel_##MB##_##NB(const gemm_args *g, int64_t m0, int64_t nb0) { micro_kernel(g, m0, nb0, MB, NB); }
#define KERNEL_ROW(MB) KERNEL(MB, 1) KERNEL(MB, 2) KERNEL(MB, 3) KERNEL(MB, 4)
KERNEL_ROW(1) KERNEL_ROW(2) KERNEL_ROW(3) KERNEL_ROW(4) KERNEL_ROW(5) KERNEL_ROW(6)
typedef void (*kernel_fn)(const gemm_args *, int64_t, int64_t);
#define TABLE_ROW(MB) {kernel_##MB##_1, kernel_##MB##_2, kernel_##MB##_3, kernel_##MB##_4}
static const kernel_fn KERNELS[MB_MAX][NB_MAX] = {TABLE_ROW(1), TABLE_ROW(2), TABLE_ROW(3),
                                                  TABLE_ROW(4), TABLE_ROW(5), TABLE_ROW(6)};

/* Channel blocks [nb_begin, nb_end): NB_MAX blocks at a time, all rows per chunk so the chunk's
 * weights (64 channels x Kp bytes) come from DRAM once and from L2 for the other row blocks. */
static void gemm_range(const gemm_args *g, int64_t nb_begin, int64_t nb_end) {
    for (int64_t nb = nb_begin; nb < nb_end; nb += NB_MAX) {
        int nbk = (int)(nb_end - nb < NB_MAX ? nb_end - nb : NB_MAX);
        for (int64_t m = 0; m < g->M; m += MB_MAX) {
            int mbk = (int)(g->M - m < MB_MAX ? g->M - m : MB_MAX);
            KERNELS[mbk - 1][nbk - 1](g, m, nb);
        }
    }
}

/* ---- the driver (w8a8_segments.h) and the entry points --------------------------------------- */

#include "w8a8_segments.h"

/* y[M, N] = W8A8(x[M, K]). Returns 0 on success, 1 if scratch memory could not be allocated.
 * x rows are x_stride elements apart; prescale/bias/out/acc_out may be NULL. */
int qhf_w8a8_linear(const void *x, int x_dtype, int64_t M, int64_t K, int64_t x_stride, const float *prescale,
                    const int8_t *w_packed, const int32_t *wsum128, int64_t N, int64_t Kp, const float *w_scale,
                    const void *bias, int bias_dtype, void *out, int out_dtype, int64_t out_stride,
                    int32_t *acc_out, int n_threads) {
    gemm_args g = {NULL, NULL, w_packed, wsum128, w_scale, bias, bias_dtype, out, out_dtype, out_stride,
                   acc_out, M, N, Kp};
    return run_segments(x, x_dtype, M, K, x_stride, prescale, -1.0f, Kp, &g, 1, n_threads);
}
