/*
 * Causal self-attention of a prompt (a prefill: Q == N, no cache, no padding) in bfloat16, on the
 * CPU's BF16 dot-product instruction (AVX512-BF16's vdpbf16ps: 32 bf16 multiplies, fp32 sums).
 *
 * Why: at prompt lengths of hundreds to thousands of tokens the prefill's attention is quadratic and
 * dominates it (SmolLM2-135M at 2000 tokens: 62 % of the prefill under torch's CPU flash attention,
 * which runs its blocks through fp32 GEMMs). The dot-product instruction does twice the fp32 FMA's
 * arithmetic per cycle, and a flash-style blocking keeps every block in cache.
 *
 * Per (batch, KV head, block of QB query positions), for all G = H / KVH query heads of that KV head
 * at once (each key and value block is loaded once for them), over key blocks of KB keys in order:
 *   s   = scale * q . k_j                   fp32 sums of bf16 products (vdpbf16ps)
 *   m'  = max(m, max_j s_j)                 running max per row (online softmax)
 *   p_j = bf16(e^(s_j - m'))                rounded to bf16 for the P.V products; keys after the
 *                                           row's position (causal) get p_j = 0
 *   l   = l * e^(m - m') + sum_j p_j        the rounded p_j, so the weights sum to exactly l
 *   o   = o * e^(m - m') + sum_j p_j v_j    fp32 accumulators
 * and out = bf16(o / l). Rounding p to bf16 is what flash attention does on GPUs; the output error
 * against an fp64 oracle is a few bf16 ulps (tests/test_prefill_attention.py states the bound).
 * Each (batch, head, row) depends on its own query, keys and values only, so a batched prompt gets
 * the bits it gets alone.
 *
 * Layouts (strides in elements, head dim contiguous):
 *   q [B, H, L, D], k and v [B, KVH, L, D] bfloat16 (GQA: head h reads KV head h / (H / KVH))
 *   out [B, L, H, D] bfloat16, contiguous.   D % 32 == 0, D <= 256.
 * Returns 0, 1 when scratch memory cannot be had, 2 for shapes it does not take.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <immintrin.h>

#include "qhf_entry_points.h"

#define QB 16      /* query positions per task */
#define KB 64      /* keys per block: 4 vectors of 16 scores */
#define D_MAX 256  /* head dim bound: the accumulators of one task */
#define ROWS 4     /* rows per micro-kernel */

/* K of one (batch, KV head) as [Lp/16][D/2][16 keys] pairs: lane j of vector (group, dp) holds
 * (k[16 group + j][2 dp], k[16 group + j][2 dp + 1]); keys from L to Lp (L rounded up to KB) are zeros. */
static void pack_keys(const uint16_t *k, int64_t k_sl, int64_t L, int64_t Lp, int64_t D, uint32_t *out) {
    const int64_t groups = Lp / 16, pairs = D / 2;
    for (int64_t g = 0; g < groups; ++g)
        for (int64_t j = 0; j < 16; ++j) {
            const int64_t key = g * 16 + j;
            for (int64_t dp = 0; dp < pairs; ++dp) {
                uint32_t pair = 0;
                if (key < L) memcpy(&pair, k + key * k_sl + 2 * dp, sizeof pair);
                out[(g * pairs + dp) * 16 + j] = pair;
            }
        }
}

/* V of one (batch, KV head) as [Lp/2][D] pairs: element (jp, d) holds (v[2 jp][d], v[2 jp + 1][d]),
 * zeros past L. */
static void pack_values(const uint16_t *v, int64_t v_sl, int64_t L, int64_t Lp, int64_t D, uint32_t *out) {
    for (int64_t jp = 0; jp < Lp / 2; ++jp) {
        const uint16_t *even = 2 * jp < L ? v + 2 * jp * v_sl : NULL, *odd = 2 * jp + 1 < L ? v + (2 * jp + 1) * v_sl : NULL;
        for (int64_t d = 0; d < D; ++d)
            out[jp * D + d] = (even ? (uint32_t)even[d] : 0u) | (odd ? (uint32_t)odd[d] << 16 : 0u);
    }
}

/* e^x for x <= 0 on 16 lanes (x = n ln2 + r, degree-6 polynomial; |rel err| < 2e-7); x < -87 and -inf give 0. */
static inline __m512 exp16(__m512 x) {
    const __m512 floor87 = _mm512_set1_ps(-87.0f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, floor87, _CMP_LT_OQ);
    x = _mm512_max_ps(x, floor87);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(~tiny, _mm512_mul_ps(p, _mm512_castsi512_ps(bits)));
}

static inline uint32_t pair_at(const uint16_t *row, int64_t index) {
    uint32_t pair;
    memcpy(&pair, row + index, sizeof pair);
    return pair;
}

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

/* s[r][0..KB) = q_r . k_j for ROWS rows and the KB keys from key group `group` (unscaled). */
static inline void scores_block(const uint16_t *const *q, const uint32_t *kp, int64_t group, int64_t D, float *s) {
    const int64_t pairs = D / 2;
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
    const uint32_t *base = kp + group * pairs * 16;
    for (int64_t dp = 0; dp < pairs; ++dp) {
        __m512i kv[4];
        for (int t = 0; t < 4; ++t) kv[t] = _mm512_loadu_si512(base + (t * pairs + dp) * 16);
        for (int r = 0; r < ROWS; ++r) {
            const __m512i qb = _mm512_set1_epi32((int)pair_at(q[r], 2 * dp));
            for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], as_bh(kv[t]), as_bh(qb));
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < 4; ++t) _mm512_storeu_ps(s + r * KB + t * 16, acc[r][t]);
}

/* o[r][d0 .. d0 + 16 VECS) = o * alpha[r] + sum_j p[r][j] v_j[d0 ..] over the KB keys from key pair
 * `first_pair`, for ROWS rows: VECS (4 or 2) is a constant where it is inlined, so the accumulators stay
 * in registers. */
static inline __attribute__((always_inline)) void values_chunk(const uint16_t *p, const uint32_t *vp, int64_t first_pair,
                                                               int64_t D, int64_t d0, const float *alpha, float *o,
                                                               const int VECS) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int t = 0; t < VECS; ++t) acc[r][t] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + t * 16), a);
    }
    for (int64_t jp = 0; jp < KB / 2; ++jp) {
        const uint32_t *row = vp + (first_pair + jp) * D + d0;
        __m512i vv[4];
        for (int t = 0; t < VECS; ++t) vv[t] = _mm512_loadu_si512(row + t * 16);
        for (int r = 0; r < ROWS; ++r) {
            const __m512i pb = _mm512_set1_epi32((int)pair_at(p + r * KB, 2 * jp));
            for (int t = 0; t < VECS; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], as_bh(vv[t]), as_bh(pb));
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < VECS; ++t) _mm512_storeu_ps(o + r * D + d0 + t * 16, acc[r][t]);
}

/* o[r] = o[r] * alpha[r] + sum_j p[r][j] v_j over the KB keys from key pair `first_pair`, ROWS rows. */
static inline void values_block(const uint16_t *p, const uint32_t *vp, int64_t first_pair, int64_t D, const float *alpha,
                                float *o) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) values_chunk(p, vp, first_pair, D, d0, alpha, o, 4);
    if (d0 < D) values_chunk(p, vp, first_pair, D, d0, alpha, o, 2); /* D % 64 == 32 */
}

/* Online softmax of one row's block of scores: masks keys past `visible_end`, rounds p to bf16 into
 * `p`, updates the row's max `m` and sum `l`, and returns the factor its accumulators take. */
static inline float softmax_block(float *s, int64_t first_key, int64_t visible_end, float scale, uint16_t *p, float *m,
                                  float *l) {
    __m512 x[4];
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < 4; ++t) {
        const int64_t key0 = first_key + 16 * t;
        const int64_t n = visible_end - key0;
        const __mmask16 keep = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
        x[t] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), keep, _mm512_loadu_ps(s + 16 * t), _mm512_set1_ps(scale));
        vmax = _mm512_max_ps(vmax, x[t]);
    }
    const float block_max = _mm512_reduce_max_ps(vmax);
    const float m_new = block_max > *m ? block_max : *m;
    const float alpha = m_new == *m ? 1.0f : exp16(_mm512_set1_ps(*m - m_new))[0]; /* the max rarely moves late */
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int t = 0; t < 4; t += 2) {
        const __m512bh rounded = _mm512_cvtne2ps_pbh(exp16(_mm512_sub_ps(x[t + 1], vm)), exp16(_mm512_sub_ps(x[t], vm)));
        const __m512i bits = (__m512i)rounded;
        _mm512_storeu_si512(p + 16 * t, bits);
        const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16));
        const __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16));
        sum = _mm512_add_ps(sum, _mm512_add_ps(lo, hi));
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = m_new;
    return alpha;
}

/* One task: the G heads of KV head `kvh` at query positions q0 .. q0 + QB - 1 (those below L). */
static void attend_block(const uint16_t *q, int64_t q_sh, int64_t q_sl, int64_t h0, int G, const uint32_t *kp,
                         const uint32_t *vp, uint16_t *out, int64_t out_sl, int64_t L, int64_t D, int64_t q0, float scale,
                         float *o, float *s, uint16_t *p, float *m, float *l, float *alpha) {
    const int rows = G * QB; /* row r: head h0 + r / QB, position q0 + r % QB */
    const uint16_t *qrow[G * QB];
    for (int r = 0; r < rows; ++r) {
        int64_t pos = q0 + r % QB;
        if (pos >= L) pos = L - 1; /* a ragged last block computes a real row again, never stored */
        qrow[r] = q + (h0 + r / QB) * q_sh + pos * q_sl;
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * rows * D);
    const int64_t last = (q0 + QB < L ? q0 + QB : L); /* keys 0 .. last - 1 are visible to some row */
    for (int64_t key0 = 0; key0 < last; key0 += KB) {
        for (int r0 = 0; r0 < rows; r0 += ROWS) {
            scores_block(qrow + r0, kp, key0 / 16, D, s);
            for (int r = r0; r < r0 + ROWS; ++r) {
                int64_t pos = q0 + r % QB;
                if (pos >= L) pos = L - 1;
                alpha[r - r0] = softmax_block(s + (r - r0) * KB, key0, pos + 1, scale, p + (r - r0) * KB, m + r, l + r);
            }
            values_block(p, vp, key0 / 2, D, alpha, o + r0 * D);
        }
    }
    for (int r = 0; r < rows; ++r) {
        const int64_t pos = q0 + r % QB;
        if (pos >= L) continue;
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        uint16_t *dst = out + pos * out_sl + (h0 + r / QB) * D;
        for (int64_t d = 0; d < D; d += 32) {
            const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d), inv);
            const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d + 16), inv);
            _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
    }
}

int qhf_prefill_attention(const void *q_, int64_t q_sb, int64_t q_sh, int64_t q_sl, const void *k_, int64_t k_sb,
                          int64_t k_sh, int64_t k_sl, const void *v_, int64_t v_sb, int64_t v_sh, int64_t v_sl, void *out_,
                          int64_t B, int64_t H, int64_t KVH, int64_t L, int64_t D, float scale, int n_threads) {
    if (B <= 0 || L <= 0 || KVH <= 0 || H % KVH != 0 || D % 32 != 0 || D > D_MAX || H / KVH > 64) return 2;
    const uint16_t *q = q_, *k = k_, *v = v_;
    uint16_t *out = out_;
    const int G = (int)(H / KVH);
    const int64_t Lp = (L + KB - 1) / KB * KB, per_head = Lp * D; /* K then V pairs, Lp * D / 2 words each */
    const int64_t heads = B * KVH, blocks = (L + QB - 1) / QB;
    uint32_t *packed = malloc(sizeof(uint32_t) * heads * per_head);
    if (!packed) return 1;
    if (n_threads < 1) n_threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(n_threads) reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < heads; ++bh) {
            const int64_t b = bh / KVH, kvh = bh % KVH;
            uint32_t *kp = packed + bh * per_head;
            pack_keys(k + b * k_sb + kvh * k_sh, k_sl, L, Lp, D, kp);
            pack_values(v + b * v_sb + kvh * v_sh, v_sl, L, Lp, D, kp + per_head / 2);
        } /* (the loop's barrier: every head is packed before any task reads one) */
        const int rows = G * QB;
        float *scratch = malloc(sizeof(float) * ((size_t)rows * D + ROWS * KB + 2 * (size_t)rows + ROWS));
        uint16_t *p = malloc(sizeof(uint16_t) * ROWS * KB);
        if (!scratch || !p) failed = 1;
        float *o = scratch, *s = o + (size_t)rows * D, *m = s + ROWS * KB, *l = m + rows, *alpha = l + rows;
        /* longest tasks first (the last query blocks see the most keys), handed out one at a time */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < heads * blocks; ++task) {
            if (!scratch || !p) continue;
            const int64_t block = blocks - 1 - task / heads, bh = task % heads;
            const int64_t b = bh / KVH, kvh = bh % KVH;
            const uint32_t *kp = packed + bh * per_head, *vp = kp + per_head / 2;
            attend_block(q + b * q_sb, q_sh, q_sl, kvh * G, G, kp, vp, out + b * L * H * D, H * D, L, D, block * QB, scale, o,
                         s, p, m, l, alpha);
        }
        free(scratch);
        free(p);
    }
    free(packed);
    return failed ? 1 : 0;
}
