/*
 * Row-stable attention for decode and verification shapes (few query rows over a KV cache).
 *
 * Each (batch, head, query row) is computed alone, over exactly the keys that row may see, in
 * ascending key order, with a fixed summation order that depends only on the head size:
 *   s_j = scale * dot(q, k_j)      16 lane partial sums over d by fused multiply-add, then a fixed pairwise tree
 *   p_j = e^(s_j - max_j s_j)      our own polynomial exp (libm's expf is scalar and slow)
 *   l   = sum_j p_j                16 lane partial sums over the visible keys, fixed tree
 *   o   = (sum_j p_j * v_j) * (1 / l)  per-element fused multiply-adds in key order
 * A fused multiply-add rounds once, by IEEE 754, so the vector builds (FMA instructions) and the
 * portable one (fmaf) compute the same bits.
 * So a row's output does not depend on how many other rows are in the call, on keys it may not
 * see (masked or beyond its causal limit are skipped, never added as zeros), nor on the thread
 * count: one-token decode and a (k+1)-token verification give bit-identical rows.
 * With AVX2 or AVX-512, up to HEADS_MAX query heads of one KV head (GQA) run together: each key and value
 * row is loaded and widened once for all of them, and each head's arithmetic stays its own.
 *
 * Layouts (strides in elements, head dim contiguous):
 *   q    [B, H, Q, D]       k, v [B, KVH, N, D]   (GQA: head h reads kv head h / (H / KVH))
 *   mask [B, Q, N] uint8 (1 = visible) or NULL: row i sees keys 0 .. N - Q + i (bottom-right causal)
 *   out  [B, Q, H, D] contiguous, same dtype as q (a row with no visible key gets zeros)
 * dtype: 0 = float32, 1 = bfloat16. Accumulation is fp32; bf16 output is rounded to nearest even.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16

#include "qhf_common.h"
#include "qhf_entry_points.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Element d of row `offset` of a float32 (dtype 0) or bfloat16 (dtype 1) tensor, as float32. */
static inline float element(const void *base, int64_t offset, int64_t d, int dtype) {
    return dtype == 0 ? ((const float *)base)[offset + d] : bf16_to_f32(((const uint16_t *)base)[offset + d]);
}

#ifdef __AVX512F__
static inline __m512 load16(const void *base, int64_t offset, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)base + offset);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__)
static inline __m256 load8(const void *base, int64_t offset, int dtype) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)base + offset);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + offset));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* dot(q, row): element d goes to lane d % LANES (acc = fma(q, row, acc)), then the fixed
 * tree. The AVX-512 path computes exactly the scalar path's lanes and tree (used when D % 16 == 0). */
static inline float dot_row(const float *q, const void *base, int64_t offset, int64_t D, int dtype) {
#ifdef __AVX512F__
    if (D % LANES == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += LANES)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(base, offset + d, dtype), acc);
        return tree_sum16(acc);
    }
#elif defined(__AVX2__)
    if (D % LANES == 0) { /* lanes 0..7 in lo, 8..15 in hi */
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += LANES) {
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(base, offset + d, dtype), lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(base, offset + d + 8, dtype), hi);
        }
        return tree_sum_halves(lo, hi);
    }
#endif
    float acc[LANES] = {0};
    for (int64_t d = 0; d < D; ++d) acc[d % LANES] = fmaf(q[d], element(base, offset, d, dtype), acc[d % LANES]);
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
    return acc[0];
}

/* acc[d] = fma(p, row[d], acc[d]) for every d (the same per-element operation on every path). */
static inline void axpy_row(float *acc, float p, const void *base, int64_t offset, int64_t D, int dtype) {
    int64_t d = 0;
#ifdef __AVX512F__
    const __m512 vp = _mm512_set1_ps(p);
    for (; d + LANES <= D; d += LANES)
        _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(vp, load16(base, offset + d, dtype), _mm512_loadu_ps(acc + d)));
#elif defined(__AVX2__)
    const __m256 vp = _mm256_set1_ps(p);
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(vp, load8(base, offset + d, dtype), _mm256_loadu_ps(acc + d)));
#endif
    for (; d < D; ++d) acc[d] = fmaf(p, element(base, offset, d, dtype), acc[d]);
}

/* e^x for x <= 0 (softmax after subtracting the max): Cody-Waite reduction x = n ln2 + r and a
 * degree-6 polynomial for e^r (|rel err| < 2e-7). Pure float arithmetic with a fixed order, so a
 * loop over it vectorises and every lane computes the same bits as a scalar call would. */
static inline float exp_nonpositive(float x) {
    if (x != x) return x; /* NaN in a score propagates to the output, never a silent number */
    if (x < -87.0f) return 0.0f;
    const float round_magic = 12582912.0f; /* 1.5 * 2^23: adding then subtracting rounds to nearest */
    float n = (x * 1.44269504088896341f + round_magic) - round_magic;
    float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23; /* 2^n; n >= -126 here */
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
/* exp_nonpositive on 8 lanes, operation for operation (multiply then add, no FMA): the polynomial runs
 * on x clamped to -87 (NaN to -87: max returns its second operand), then the two early returns
 * of the scalar code become selects. */
static inline __m256 exp_nonpositive8(__m256 x) {
    const __m256 floor87 = _mm256_set1_ps(-87.0f), round_magic = _mm256_set1_ps(12582912.0f);
    const __m256 xc = _mm256_max_ps(x, floor87);
    const __m256 n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)), round_magic), round_magic);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps(x, floor87, _CMP_LT_OQ));
    return _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}
#endif

/* max_j s_j as `m = s[j] > m ? s[j] : m` from m = s[0] computes it: NaN scores are passed over unless
 * s[0] is one. The vector paths keep that rule in every lane (each starts from s[0]) and between lanes;
 * they can differ from the scalar loop only in which zero they return when the max is +-0, and
 * s_j - (+0) and s_j - (-0) round alike for every s_j but zeros, whose e^ is 1 either way. */
static float max_score(const float *s, int64_t count) {
    float m = s[0];
    int64_t j = 1;
#ifdef __AVX512F__
    if (count > LANES) {
        __m512 vm = _mm512_set1_ps(m);
        for (; j + LANES <= count; j += LANES) {
            const __m512 x = _mm512_loadu_ps(s + j);
            vm = _mm512_mask_mov_ps(vm, _mm512_cmp_ps_mask(x, vm, _CMP_GT_OQ), x);
        }
        float lanes[LANES];
        _mm512_storeu_ps(lanes, vm);
        for (int l = 0; l < LANES; ++l) m = lanes[l] > m ? lanes[l] : m;
    }
#elif defined(__AVX2__)
    if (count > 8) {
        __m256 vm = _mm256_set1_ps(m);
        for (; j + 8 <= count; j += 8) {
            const __m256 x = _mm256_loadu_ps(s + j);
            vm = _mm256_blendv_ps(vm, x, _mm256_cmp_ps(x, vm, _CMP_GT_OQ));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, vm);
        for (int l = 0; l < 8; ++l) m = lanes[l] > m ? lanes[l] : m;
    }
#endif
    for (; j < count; ++j) m = s[j] > m ? s[j] : m;
    return m;
}

/* p_j = e^(s_j - max) in place; returns sum_j p_j in LANES partial sums (lane = j % LANES) and a
 * fixed tree: depends only on the (compacted) visible scores, never on other rows. */
static float softmax_numerators(float *s, int64_t count) {
    const float m = max_score(s, count);
    float acc[LANES] = {0};
    int64_t j = 0;
#if defined(__AVX2__) && !defined(__AVX512F__)
    { /* GCC does not vectorize exp_nonpositive's branches for AVX2: the same operations, 8 lanes at a time */
        __m256 acc_lo = _mm256_setzero_ps(), acc_hi = _mm256_setzero_ps();
        const __m256 vm = _mm256_set1_ps(m);
        for (; j + LANES <= count; j += LANES) {
            const __m256 e_lo = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
            const __m256 e_hi = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), vm));
            _mm256_storeu_ps(s + j, e_lo);
            _mm256_storeu_ps(s + j + 8, e_hi);
            acc_lo = _mm256_add_ps(acc_lo, e_lo);
            acc_hi = _mm256_add_ps(acc_hi, e_hi);
        }
        _mm256_storeu_ps(acc, acc_lo);
        _mm256_storeu_ps(acc + 8, acc_hi);
    }
#endif
    for (; j + LANES <= count; j += LANES)
        for (int l = 0; l < LANES; ++l) {
            s[j + l] = exp_nonpositive(s[j + l] - m);
            acc[l] += s[j + l];
        }
    for (int l = 0; j + l < count; ++l) {
        s[j + l] = exp_nonpositive(s[j + l] - m);
        acc[l] += s[j + l];
    }
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) acc[l] += acc[l + width];
    return acc[0];
}

typedef struct {
    const void *q, *k, *v;
    const uint8_t *mask;
    int64_t q_sb, q_sh, q_sq, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, m_sb, m_sq;
    int64_t H, Q, N, D, group;
    float scale;
    int dtype;
    void *out;
} Problem;

/* sum_t p[t] * v[keys[t]] into out[0 .. D): per element, fused multiply-adds in t order from 0.0f.
 * For the common head sizes the accumulators live in registers; every path computes the same bits. */
#ifdef __AVX512F__
#define DEFINE_WEIGHTED_SUM(DIM)                                                                   \
    static void weighted_sum_##DIM(float *out, const float *p, const int32_t *keys, int64_t count,  \
                                   const void *v, int64_t v_base, int64_t v_sn, int dtype) {        \
        __m512 acc[DIM / LANES];                                                                   \
        for (int c = 0; c < DIM / LANES; ++c) acc[c] = _mm512_setzero_ps();                        \
        for (int64_t t = 0; t < count; ++t) {                                                      \
            const __m512 vp = _mm512_set1_ps(p[t]);                                                \
            const int64_t off = v_base + keys[t] * v_sn;                                           \
            for (int c = 0; c < DIM / LANES; ++c)                                                  \
                acc[c] = _mm512_fmadd_ps(vp, load16(v, off + c * LANES, dtype), acc[c]);            \
        }                                                                                          \
        for (int c = 0; c < DIM / LANES; ++c) _mm512_storeu_ps(out + c * LANES, acc[c]);           \
    }
DEFINE_WEIGHTED_SUM(64)
DEFINE_WEIGHTED_SUM(128)
#elif defined(__AVX2__)
/* 64 elements in 8 registers; a head of 128 takes two such passes (each element's sum is its own). */
static void weighted_sum_64(float *out, const float *p, const int32_t *keys, int64_t count, const void *v,
                            int64_t v_base, int64_t v_sn, int dtype) {
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t t = 0; t < count; ++t) {
        const __m256 vp = _mm256_set1_ps(p[t]);
        const int64_t off = v_base + keys[t] * v_sn;
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(vp, load8(v, off + c * 8, dtype), acc[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(out + c * 8, acc[c]);
}

static void weighted_sum_128(float *out, const float *p, const int32_t *keys, int64_t count, const void *v,
                             int64_t v_base, int64_t v_sn, int dtype) {
    weighted_sum_64(out, p, keys, count, v, v_base, v_sn, dtype);
    weighted_sum_64(out + 64, p, keys, count, v, v_base + 64, v_sn, dtype);
}
#endif

static void weighted_sum(float *out, const float *p, const int32_t *keys, int64_t count, const void *v,
                         int64_t v_base, int64_t v_sn, int64_t D, int dtype) {
#if defined(__AVX2__) || defined(__AVX512F__)
    if (D == 64) {
        weighted_sum_64(out, p, keys, count, v, v_base, v_sn, dtype);
        return;
    }
    if (D == 128) {
        weighted_sum_128(out, p, keys, count, v, v_base, v_sn, dtype);
        return;
    }
#endif
    for (int64_t d = 0; d < D; ++d) out[d] = 0.0f;
    for (int64_t t = 0; t < count; ++t) axpy_row(out, p[t], v, v_base + keys[t] * v_sn, D, dtype);
}

/* The keys j < end a row sees (mask_row[j] != 0; all of them without a mask), ascending, into keys;
 * returns how many. The mask is read 8 bytes at a time: a static cache's unwritten slots (hundreds
 * per row) are skipped a word at a time, and a word of visible keys is taken whole. */
static int64_t visible_keys(const uint8_t *mask_row, int64_t end, int32_t *keys) {
    int64_t count = 0, j = 0;
    if (mask_row) {
        const uint64_t all = 0x0101010101010101ull; /* 8 visible keys (the mask holds 0 or 1) */
        for (; j + 8 <= end; j += 8) {
            uint64_t word;
            memcpy(&word, mask_row + j, sizeof word);
            if (word == 0) continue;
            for (int t = 0; t < 8; ++t)
                if (word == all || mask_row[j + t]) keys[count++] = (int32_t)(j + t);
        }
    }
    for (; j < end; ++j)
        if (!mask_row || mask_row[j]) keys[count++] = (int32_t)j;
    return count;
}

/* out[b, i, h, :] = acc * inv, in the output's dtype. */
static void store_row(const Problem *P, int64_t b, int64_t h, int64_t i, const float *acc, float inv) {
    const int64_t D = P->D, out_off = ((b * P->Q + i) * P->H + h) * D;
    if (P->dtype == 0) {
        float *o = (float *)P->out + out_off;
        for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * inv;
    } else {
        uint16_t *o = (uint16_t *)P->out + out_off;
        for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(acc[d] * inv);
    }
}

/* Query row i of head h, batch b, alone. scratch: N scores, N key indices, 2 * D floats. */
static void attend_row(const Problem *P, int64_t b, int64_t h, int64_t i, float *scratch) {
    const int64_t N = P->N, D = P->D, kvh = h / P->group;
    float *scores = scratch;                     /* [N]: scores of the visible keys, in key order */
    int32_t *keys = (int32_t *)(scores + N);     /* [N]: their indices */
    float *qf = (float *)(keys + N);             /* [D] */
    float *acc = qf + D;                         /* [D] */
    const int64_t q_off = b * P->q_sb + h * P->q_sh + i * P->q_sq;
    for (int64_t d = 0; d < D; ++d) qf[d] = element(P->q, q_off, d, P->dtype);
    const uint8_t *mask_row = P->mask ? P->mask + b * P->m_sb + i * P->m_sq : NULL;
    const int64_t end = P->mask ? N : N - P->Q + i + 1; /* bottom-right causal without a mask */
    const int64_t k_base = b * P->k_sb + kvh * P->k_sh, v_base = b * P->v_sb + kvh * P->v_sh;
    const int64_t count = visible_keys(mask_row, end, keys);
    for (int64_t t = 0; t < count; ++t) scores[t] = dot_row(qf, P->k, k_base + keys[t] * P->k_sn, D, P->dtype) * P->scale;
    float inv = 0.0f;
    if (count) {
        inv = 1.0f / softmax_numerators(scores, count);
        weighted_sum(acc, scores, keys, count, P->v, v_base, P->v_sn, D, P->dtype);
    } else {
        for (int64_t d = 0; d < D; ++d) acc[d] = 0.0f;
    }
    store_row(P, b, h, i, acc, inv);
}

#if defined(__AVX512F__) || defined(__AVX2__)
#include "rowstable_attention_heads.h"
#else
#define HEADS_MAX 1
#endif

/* Heads per task: a kv head's `group` query heads see the same keys, so up to HEADS_MAX of them run
 * together (AVX2 or AVX-512, D % 64 == 0), in blocks of ceil(group / blocks) heads (the last may be
 * smaller), made smaller while there are fewer than two tasks per thread. Which rows run together
 * never changes a row's bits. */
static int heads_per_task(int64_t group, int64_t D, int64_t other_tasks, int n_threads) {
    if (HEADS_MAX == 1 || D % 64 != 0) return 1;
    int64_t blocks = (group + HEADS_MAX - 1) / HEADS_MAX;
    while (blocks < group && other_tasks * blocks < 2 * (int64_t)n_threads) ++blocks;
    return (int)((group + blocks - 1) / blocks);
}

int qhf_rowstable_attention(
    const void *q, int64_t q_sb, int64_t q_sh, int64_t q_sq,
    const void *k, int64_t k_sb, int64_t k_sh, int64_t k_sn,
    const void *v, int64_t v_sb, int64_t v_sh, int64_t v_sn,
    const uint8_t *mask, int64_t m_sb, int64_t m_sq,
    void *out, int64_t B, int64_t H, int64_t KVH, int64_t Q, int64_t N, int64_t D,
    float scale, int dtype, int n_threads) {
    if (KVH <= 0 || H % KVH != 0 || N < Q || N > INT32_MAX || (dtype != 0 && dtype != 1)) return 2;
    const Problem P = {q, k, v, mask, q_sb, q_sh, q_sq, k_sb, k_sh, k_sn, v_sb, v_sh, v_sn, m_sb, m_sq,
                       H, Q, N, D, H / KVH, scale, dtype, out};
    const int64_t group = H / KVH;
    const int per_task = heads_per_task(group, D, B * KVH * Q, n_threads);
    const int64_t blocks = (group + per_task - 1) / per_task; /* per kv head; the last may be smaller */
    const int64_t tasks = B * KVH * blocks * Q;
    int failed = 0;
#pragma omp parallel num_threads(n_threads) if (n_threads > 1 && tasks > 1) reduction(| : failed)
    {
        float *scratch = (float *)malloc((size_t)((per_task + 1) * N + 2 * per_task * D) * sizeof(float));
        if (!scratch) failed = 1;
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; ++task) {
            if (!scratch) continue;
            const int64_t i = task % Q, block = (task / Q) % blocks, kvh = (task / (Q * blocks)) % KVH;
            const int64_t b = task / (Q * blocks * KVH), h0 = kvh * group + block * per_task;
#if HEADS_MAX > 1
            if (per_task > 1) {
                const int64_t left = group - block * per_task; /* the last block may be smaller */
                attend_heads(&P, b, h0, (int)(left < per_task ? left : per_task), i, scratch);
                continue;
            }
#endif
            attend_row(&P, b, h0, i, scratch);
        }
        free(scratch);
    }
    return failed ? 1 : 0;
}
