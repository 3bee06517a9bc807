/* Fused W8A8 linear for x86-64 CPUs with AVX2 but no AVX-512 VNNI (quasar_hf.ops.cpu_fused).
 *
 * The same entry points, arguments, packed weight layout and numerics as w8a8_vnni.c, so a model
 * computes the same bits on every x86-64 CPU: per-token INT8 quantization (optionally with an
 * RMSNorm folded in) -> exact int32 GEMM -> dequantizing epilogue, op for op as
 * quasar_hf/ops/reference.py. Build WITHOUT -ffast-math and WITH -ffp-contract=off.
 *
 * Float lanes: every float op here is one IEEE add/mul/div/sqrt/max/floor per element in the
 * order of w8a8_vnni.c; the 16-lane RMS reduction is kept as two 8-lane halves summed by the
 * same tree, so the rounding matches the AVX-512 kernel bit for bit.
 *
 * Integer products without VNNI: maddubs multiplies unsigned by signed bytes and adds pairs with
 * int16 saturation. With |w| as the unsigned operand (<= 128) and sign(w) * q as the signed one
 * (|q| <= 127), a pair is at most 2 * 128 * 127 = 32512 < 32767: never saturated, so every
 * product is exact; madd with ones then adds the pairs of each 4-byte group into int32. The
 * activations are therefore stored as plain int8 q, and wsum128 (the VNNI kernel's +128
 * correction) is not needed. int32 sums wrap like dpbusd's: exact while |acc| < 2^31.
 *
 * Each thread streams its channel blocks' packed bytes once; the micro-kernel prefetches
 * PF_BYTES ahead of its loads, which the hardware prefetcher (it stops at 4 KB pages) does not
 * cover: 7 % at M = 1 and 13 % at M = 6 over SmolLM2's 210 linears on an AVX2 EPYC. No arithmetic
 * changes.
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
#define UNROLL _Pragma("GCC unroll 4") /* keep the accumulators in registers */
#define MB_MAX 4 /* rows per register block: 4 x 2 accumulators + 2 |w| + 2 w + temporaries (of 16 ymm) */
#define PF_BYTES 1024 /* how far ahead of its loads the micro-kernel prefetches packed weights */

/* ---- dtype conversion (8 lanes; a tail shorter than 8 goes through a zero-padded buffer) ----- */

static inline __m256 load8_full(const void *p, int dtype, int64_t i) {
    if (dtype == DT_F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dtype == DT_BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

/* Elements i .. i + min(8, n - i) of a bf16/fp16/fp32 array -> fp32 (exact); lanes past n = 0. */
static inline __m256 load8_f32(const void *p, int dtype, int64_t i, int64_t n) {
    if (n - i >= 8) return load8_full(p, dtype, i);
    uint32_t buf[8] = {0};
    const size_t elem = dtype == DT_F32 ? 4 : 2;
    uint16_t half[8] = {0};
    if (elem == 4) memcpy(buf, (const char *)p + i * 4, (size_t)(n - i) * 4);
    else memcpy(half, (const char *)p + i * 2, (size_t)(n - i) * 2);
    return elem == 4 ? _mm256_loadu_ps((const float *)buf) : load8_full(half, dtype, 0);
}

/* fp32 -> bf16, round to nearest even, NaN -> 0x7fc0 (as w8a8_vnni.c and c10::BFloat16). */
static inline __m128i f32x8_to_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), is_nan);
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    return _mm_packus_epi32(lo, hi); /* values <= 0xffff: exact */
}

/* Store lanes 0 .. count-1 of v at element i of a bf16/fp16/fp32 array. */
static inline void store8(void *p, int dtype, int64_t i, __m256 v, int count) {
    if (dtype == DT_F32) {
        if (count == 8) { _mm256_storeu_ps((float *)p + i, v); return; }
        float buf[8];
        _mm256_storeu_ps(buf, v);
        memcpy((float *)p + i, buf, (size_t)count * 4);
        return;
    }
    __m128i h = dtype == DT_BF16 ? f32x8_to_bf16(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    if (count == 8) { _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h); return; }
    uint16_t buf[8];
    _mm_storeu_si128((__m128i *)buf, h);
    memcpy((uint16_t *)p + i, buf, (size_t)count * 2);
}

/* ---- per-token quantization ---------------------------------------------------------------- */

static inline __m256 row8(const void *x, int dtype, const float *prescale, int64_t i, int64_t K) {
    __m256 v = load8_f32(x, dtype, i, K);
    if (prescale) v = _mm256_mul_ps(v, load8_f32(prescale, DT_F32, i, K));
    return v;
}

/* lanes (l, l + 4), (l, l + 2), (l, l + 1) of an 8-lane sum: tree_sum16 after its first step. */
static inline float tree_sum8(__m256 s8) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    return _mm_cvtss_f32(s1);
}

/* 1 / sqrt(mean(x^2) + eps): 16 lanes (two halves) over k ascending, mul then add, then the tree. */
static float rms_factor(const void *x, int dtype, int64_t K, float eps) {
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __m256 a = load8_f32(x, dtype, k, K);
        __m256 b = k + 8 < K ? load8_f32(x, dtype, k + 8, K) : _mm256_setzero_ps();
        lo = _mm256_add_ps(lo, _mm256_mul_ps(a, a));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(b, b));
    }
    return 1.0f / sqrtf(tree_sum8(_mm256_add_ps(lo, hi)) / (float)K + eps);
}

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* One row: aq[0:Kp] = q (int8), returns the epilogue scale; the rules of w8a8_vnni.c quantize_row. */
static float quantize_row(const void *x, int dtype, const float *prescale, int64_t K, int64_t Kp, int8_t *aq, float norm_eps) {
    const float r = norm_eps >= 0.0f ? rms_factor(x, dtype, K, norm_eps) : 1.0f;
    __m256 vmax = _mm256_setzero_ps();
    __m256i nonfinite = _mm256_setzero_si256();
    const __m256i abs_bits = _mm256_set1_epi32(0x7fffffff), below_inf = _mm256_set1_epi32(0x7f7fffff);
    for (int64_t k = 0; k < K; k += 8) {
        __m256i a = _mm256_and_si256(_mm256_castps_si256(row8(x, dtype, prescale, k, K)), abs_bits);
        nonfinite = _mm256_or_si256(nonfinite, _mm256_cmpgt_epi32(a, below_inf));
        vmax = _mm256_max_ps(vmax, _mm256_castsi256_ps(a));
    }
    float amax = hmax8(vmax);
    if (!_mm256_testz_si256(nonfinite, nonfinite) || amax == 0.0f) {
        memset(aq, 0, (size_t)Kp);
        return !_mm256_testz_si256(nonfinite, nonfinite) ? __builtin_nanf("") : 0.0f;
    }
    const __m256 inv = _mm256_set1_ps((1.0f / amax) * 127.0f);
    const __m256 half = _mm256_set1_ps(0.5f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (int64_t k = 0; k < K; k += 8) {
        __m256 v = _mm256_add_ps(_mm256_mul_ps(row8(x, dtype, prescale, k, K), inv), half);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q)); /* NaN (subnormal amax) -> 0 */
        v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
        __m256i q = _mm256_cvtps_epi32(v);
        __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
        __m128i q8 = _mm_packs_epi16(q16, q16);
        int64_t count = K - k < 8 ? K - k : 8;
        memcpy(aq + k, &q8, (size_t)count);
    }
    for (int64_t k = K; k < Kp; ++k) aq[k] = 0;
    return norm_eps >= 0.0f ? (amax / 127.0f) * r : amax / 127.0f;
}

/* ---- GEMM micro-kernel with fused epilogue ------------------------------------------------- */

typedef int8_t act_t; /* q itself */

#include "w8a8_gemm_args.h"

/* 8 channels n .. n + 7 of row m: exact int32 -> epilogue -> stores. */
static inline void epilogue8(const gemm_args *g, int64_t m, int64_t n, __m256i acc) {
    if (n >= g->N) return;
    const int count = g->N - n < 8 ? (int)(g->N - n) : 8;
    if (g->acc_out) {
        int32_t buf[8];
        _mm256_storeu_si256((__m256i *)buf, acc);
        memcpy(g->acc_out + m * g->N + n, buf, (size_t)count * 4);
    }
    if (!g->out) return;
    __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(g->a_scale[m]));
    y = _mm256_mul_ps(y, load8_f32(g->w_scale, DT_F32, n, g->N));
    if (g->bias) y = _mm256_add_ps(y, load8_f32(g->bias, g->bias_dtype, n, g->N));
    store8(g->out, g->out_dtype, m * g->out_stride + n, y, count);
}

/* MB rows x one block of 16 channels (two 8-channel halves of the 64-byte packed row). */
static inline __attribute__((always_inline)) void micro_kernel(const gemm_args *g, int64_t m0, int64_t nb, const int MB) {
    __m256i acc[MB_MAX][2];
    UNROLL for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    const int64_t kgroups = g->Kp / 4;
    const int8_t *w = g->w + nb * g->Kp * 16;
    const int8_t *a = g->aq + m0 * g->Kp;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t kg = 0; kg < kgroups; ++kg) {
        _mm_prefetch((const char *)(w + kg * 64 + PF_BYTES), _MM_HINT_T0);
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + kg * 64));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + kg * 64 + 32));
        const __m256i abs0 = _mm256_abs_epi8(w0), abs1 = _mm256_abs_epi8(w1); /* |-128| = 128 as unsigned */
        UNROLL for (int i = 0; i < MB; ++i) {
            int32_t a4;
            memcpy(&a4, a + i * g->Kp + kg * 4, 4);
            const __m256i av = _mm256_set1_epi32(a4);
            const __m256i p0 = _mm256_maddubs_epi16(abs0, _mm256_sign_epi8(av, w0));
            const __m256i p1 = _mm256_maddubs_epi16(abs1, _mm256_sign_epi8(av, w1));
            acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(p0, ones));
            acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(p1, ones));
        }
    }
    UNROLL for (int i = 0; i < MB; ++i) {
        epilogue8(g, m0 + i, nb * 16, acc[i][0]);
        epilogue8(g, m0 + i, nb * 16 + 8, acc[i][1]);
    }
}

static void kernel_1(const gemm_args *g, int64_t m0, int64_t nb) { micro_kernel(g, m0, nb, 1); }
static void kernel_2(const gemm_args *g, int64_t m0, int64_t nb) { micro_kernel(g, m0, nb, 2); }
static void kernel_3(const gemm_args *g, int64_t m0, int64_t nb) { micro_kernel(g, m0, nb, 3); }
static void kernel_4(const gemm_args *g, int64_t m0, int64_t nb) { micro_kernel(g, m0, nb, 4); }
typedef void (*kernel_fn)(const gemm_args *, int64_t, int64_t);
static const kernel_fn KERNELS[MB_MAX] = {kernel_1, kernel_2, kernel_3, kernel_4};

/* Channel blocks [nb_begin, nb_end), each for all rows (its 16 x Kp weight bytes stay in L1/L2). */
static void gemm_range(const gemm_args *g, int64_t nb_begin, int64_t nb_end) {
    for (int64_t nb = nb_begin; nb < nb_end; ++nb)
        for (int64_t m = 0; m < g->M; m += MB_MAX) {
            int mbk = (int)(g->M - m < MB_MAX ? g->M - m : MB_MAX);
            KERNELS[mbk - 1](g, m, nb);
        }
}

/* ---- the driver (w8a8_segments.h) and the entry points (the signatures of w8a8_vnni.c) ------- */

#include "w8a8_segments.h"

int qhf_w8a8_linear(const void *x, int x_dtype, int64_t M, int64_t K, int64_t x_stride, const float *prescale,
                    const int8_t *w_packed, const int32_t *wsum128, int64_t N, int64_t Kp, const float *w_scale,
                    const void *bias, int bias_dtype, void *out, int out_dtype, int64_t out_stride,
                    int32_t *acc_out, int n_threads) {
    gemm_args g = {NULL, NULL, w_packed, wsum128, w_scale, bias, bias_dtype, out, out_dtype, out_stride, acc_out, M, N, Kp};
    return run_segments(x, x_dtype, M, K, x_stride, prescale, -1.0f, Kp, &g, 1, n_threads);
}
