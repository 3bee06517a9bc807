/* The prompt kernel's 16-lane fp32 arithmetic (prefill_attention_bf16.c), written once for its three
 * builds: a v16 is one __m512 where AVX-512F is on, else two __m256 (lanes 0..7, 8..15). Every
 * operation is lane-wise IEEE arithmetic, or a reduction by one fixed tree, so all builds compute the
 * same bits; the kernel runs with MXCSR FTZ and DAZ set (prefill_flush_denormals), as vdpbf16ps
 * and vcvtne2ps2bf16 always behave. */
#ifndef QHF_PREFILL_ATTENTION_ISA_H
#define QHF_PREFILL_ATTENTION_ISA_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "qhf_common.h"

#ifdef __AVX512F__
typedef __m512 v16;
typedef __m512i v16i;
#define V16_LANEWISE(name, expr512, expr256) \
    static inline v16 name(v16 a, v16 b) { return expr512; }
#define V16I_LANEWISE(name, expr512, expr256) \
    static inline v16i name(v16i a, v16i b) { return expr512; }
static inline v16 v16_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v16_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v16_store(float *p, v16 x) { _mm512_storeu_ps(p, x); }
static inline v16 v16_fmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v16_fnmadd(v16 a, v16 b, v16 c) { return _mm512_fnmadd_ps(a, b, c); }
static inline v16 v16_round(v16 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline v16i v16_to_int(v16 x) { return _mm512_cvtps_epi32(x); }
static inline v16i v16_bits(v16 x) { return _mm512_castps_si512(x); }
static inline v16 v16_from_bits(v16i x) { return _mm512_castsi512_ps(x); }
static inline v16i v16i_set1(int32_t x) { return _mm512_set1_epi32(x); }
static inline v16i v16i_shl(v16i x, int n) { return _mm512_slli_epi32(x, (unsigned)n); }
static inline v16i v16i_shr(v16i x, int n) { return _mm512_srli_epi32(x, (unsigned)n); }
/* where[i] ? a[i] : b[i], `where` from a comparison of two integer vectors */
static inline v16i v16i_select_gt(v16i x, v16i y, v16i a, v16i b) {
    return _mm512_mask_mov_epi32(b, _mm512_cmpgt_epi32_mask(x, y), a);
}
static inline v16i v16i_select_eq(v16i x, v16i y, v16i a, v16i b) {
    return _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(x, y), a);
}
/* x where !(x < floor) (NaN kept), else 0 */
static inline v16 v16_zero_below(v16 value, v16 x, v16 floor) {
    return _mm512_maskz_mov_ps(~_mm512_cmp_ps_mask(x, floor, _CMP_LT_OQ), value);
}
/* lanes i < n: s[i] * scale; the others -inf */
static inline v16 v16_scaled_prefix(const float *s, int64_t n, float scale) {
    const __mmask16 keep = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
    return _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), keep, _mm512_loadu_ps(s), _mm512_set1_ps(scale));
}
static inline __m256 v16_low(v16 x) { return _mm512_castps512_ps256(x); }
static inline __m256 v16_high(v16 x) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)); }
static inline float v16_first(v16 x) { return _mm512_cvtss_f32(x); }
#else
typedef struct { __m256 lo, hi; } v16;
typedef struct { __m256i lo, hi; } v16i;
#define V16_LANEWISE(name, expr512, expr256)                   \
    static inline __m256 name##_half(__m256 a, __m256 b) { return expr256; } \
    static inline v16 name(v16 a, v16 b) { return (v16){name##_half(a.lo, b.lo), name##_half(a.hi, b.hi)}; }
#define V16I_LANEWISE(name, expr512, expr256)                    \
    static inline __m256i name##_half(__m256i a, __m256i b) { return expr256; } \
    static inline v16i name(v16i a, v16i b) { return (v16i){name##_half(a.lo, b.lo), name##_half(a.hi, b.hi)}; }
static inline v16 v16_set1(float x) { return (v16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline v16 v16_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v16_store(float *p, v16 x) { _mm256_storeu_ps(p, x.lo), _mm256_storeu_ps(p + 8, x.hi); }
static inline v16 v16_fmadd(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16 v16_fnmadd(v16 a, v16 b, v16 c) {
    return (v16){_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16 v16_round(v16 x) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return (v16){_mm256_round_ps(x.lo, mode), _mm256_round_ps(x.hi, mode)};
}
static inline v16i v16_to_int(v16 x) { return (v16i){_mm256_cvtps_epi32(x.lo), _mm256_cvtps_epi32(x.hi)}; }
static inline v16i v16_bits(v16 x) { return (v16i){_mm256_castps_si256(x.lo), _mm256_castps_si256(x.hi)}; }
static inline v16 v16_from_bits(v16i x) { return (v16){_mm256_castsi256_ps(x.lo), _mm256_castsi256_ps(x.hi)}; }
static inline v16i v16i_set1(int32_t x) { return (v16i){_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
static inline v16i v16i_shl(v16i x, int n) { return (v16i){_mm256_slli_epi32(x.lo, n), _mm256_slli_epi32(x.hi, n)}; }
static inline v16i v16i_shr(v16i x, int n) { return (v16i){_mm256_srli_epi32(x.lo, n), _mm256_srli_epi32(x.hi, n)}; }
static inline v16i v16i_select_gt(v16i x, v16i y, v16i a, v16i b) {
    return (v16i){_mm256_blendv_epi8(b.lo, a.lo, _mm256_cmpgt_epi32(x.lo, y.lo)),
                  _mm256_blendv_epi8(b.hi, a.hi, _mm256_cmpgt_epi32(x.hi, y.hi))};
}
static inline v16i v16i_select_eq(v16i x, v16i y, v16i a, v16i b) {
    return (v16i){_mm256_blendv_epi8(b.lo, a.lo, _mm256_cmpeq_epi32(x.lo, y.lo)),
                  _mm256_blendv_epi8(b.hi, a.hi, _mm256_cmpeq_epi32(x.hi, y.hi))};
}
static inline v16 v16_zero_below(v16 value, v16 x, v16 floor) {
    return (v16){_mm256_andnot_ps(_mm256_cmp_ps(x.lo, floor.lo, _CMP_LT_OQ), value.lo),
                 _mm256_andnot_ps(_mm256_cmp_ps(x.hi, floor.hi, _CMP_LT_OQ), value.hi)};
}
static inline v16 v16_scaled_prefix(const float *s, int64_t n, float scale) {
    const __m256i count = _mm256_set1_epi32((int)(n < 0 ? 0 : n > 16 ? 16 : n));
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale);
    const __m256i lo_index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), hi_index = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
    const __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(s), vscale), hi = _mm256_mul_ps(_mm256_loadu_ps(s + 8), vscale);
    return (v16){_mm256_blendv_ps(minus_inf, lo, _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, lo_index))),
                 _mm256_blendv_ps(minus_inf, hi, _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, hi_index)))};
}
static inline __m256 v16_low(v16 x) { return x.lo; }
static inline __m256 v16_high(v16 x) { return x.hi; }
static inline float v16_first(v16 x) { return _mm256_cvtss_f32(x.lo); }
#endif

V16_LANEWISE(v16_add, _mm512_add_ps(a, b), _mm256_add_ps(a, b))
V16_LANEWISE(v16_sub, _mm512_sub_ps(a, b), _mm256_sub_ps(a, b))
V16_LANEWISE(v16_mul, _mm512_mul_ps(a, b), _mm256_mul_ps(a, b))
V16_LANEWISE(v16_max, _mm512_max_ps(a, b), _mm256_max_ps(a, b))
V16I_LANEWISE(v16i_add, _mm512_add_epi32(a, b), _mm256_add_epi32(a, b))
V16I_LANEWISE(v16i_and, _mm512_and_si512(a, b), _mm256_and_si256(a, b))
V16I_LANEWISE(v16i_or, _mm512_or_si512(a, b), _mm256_or_si256(a, b))

/* e^x for x <= 0 (x = n ln2 + r, degree-6 polynomial; |rel err| < 2e-7); x < -87 and -inf give 0.
 * Its results are 0 or normal (never denormal): n >= -126, and r > 0 where n = -126. */
static inline v16 exp16(v16 x) {
    const v16 floor87 = v16_set1(-87.0f);
    const v16 clamped = v16_max(x, floor87);
    const v16 n = v16_round(v16_mul(clamped, v16_set1(1.44269504088896341f)));
    const v16 r = v16_fnmadd(n, v16_set1(-2.12194440e-4f), v16_fnmadd(n, v16_set1(0.693359375f), clamped));
    v16 p = v16_set1(1.0f / 720.0f);
    p = v16_fmadd(p, r, v16_set1(1.0f / 120.0f));
    p = v16_fmadd(p, r, v16_set1(1.0f / 24.0f));
    p = v16_fmadd(p, r, v16_set1(1.0f / 6.0f));
    p = v16_fmadd(p, r, v16_set1(0.5f));
    p = v16_fmadd(p, r, v16_set1(1.0f));
    p = v16_fmadd(p, r, v16_set1(1.0f));
    const v16i bits = v16i_shl(v16i_add(v16_to_int(n), v16i_set1(127)), 23);
    return v16_zero_below(v16_mul(p, v16_from_bits(bits)), x, floor87);
}

/* x rounded to bfloat16 (kept as fp32, low 16 bits zero) as vcvtne2ps2bf16 rounds: to nearest even,
 * denormals to signed zero, NaN to a quiet NaN. */
static inline v16 v16_round_bf16(v16 x) {
    const v16i u = v16_bits(x), magnitude = v16i_and(u, v16i_set1(0x7fffffff)), high = v16i_set1((int32_t)0xffff0000u);
    const v16i lsb = v16i_and(v16i_shr(u, 16), v16i_set1(1));
    const v16i rounded = v16i_and(v16i_add(u, v16i_add(v16i_set1(0x7fff), lsb)), high);
    const v16i quiet = v16i_and(v16i_or(u, v16i_set1(0x00400000)), high);
    const v16i finite = v16i_select_gt(magnitude, v16i_set1(0x7f800000), quiet, rounded);
    const v16i sign = v16i_and(u, v16i_set1((int32_t)0x80000000u));
    return v16_from_bits(v16i_select_eq(v16i_and(u, v16i_set1(0x7f800000)), v16i_set1(0), sign, finite));
}

/* max of the 16 lanes by the tree (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1) */
static inline float v16_reduce_max(v16 x) {
    const __m256 m8 = _mm256_max_ps(v16_low(x), v16_high(x));
    const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    return _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
}

static inline float v16_reduce_add(v16 x) { return tree_sum_halves(v16_low(x), v16_high(x)); }

/* Sets MXCSR's flush-to-zero and denormals-are-zero bits for this thread; returns the value to restore. */
static inline unsigned prefill_flush_denormals(void) {
    const unsigned saved = _mm_getcsr();
    _mm_setcsr(saved | 0x8040u);
    return saved;
}
#endif
