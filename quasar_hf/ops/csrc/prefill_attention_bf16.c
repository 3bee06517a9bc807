/*
 * Causal self-attention of a prompt in bfloat16 (a prefill, or the continuation of one: the Q queries
 * are the last Q of N keys, row i sees keys 0 .. N - Q + i; no padding, no holes), on the
 * CPU's BF16 dot-product instruction (AVX512-BF16's vdpbf16ps: 32 bf16 multiplies, fp32 sums), or,
 * built without it (-mavx512f; -mavx2 -mfma), on fp32 FMAs that compute the same bits: vdpbf16ps adds
 * its two products of a lane in fp32 as two FMAs, the odd element's first, with denormals flushed
 * (products of two bf16 are exact in fp32). Those builds unpack K and V to fp32 once and take each
 * lane's two products in that order; every build runs with MXCSR FTZ and DAZ set, so the fp32
 * arithmetic around the products flushes alike (prefill_attention_isa.h, the 16-lane layer they share).
 *
 * Why: at prompt lengths of hundreds to thousands of tokens the prefill's attention is quadratic and
 * dominates it (SmolLM2-135M at 2000 tokens: 62 % of the prefill under torch's CPU flash attention,
 * which runs its blocks through fp32 GEMMs). The dot-product instruction does twice the fp32 FMA's
 * arithmetic per cycle (the FMA builds run at about half its speed), and a flash-style blocking keeps
 * every block in cache.
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
 * the bits it gets alone, and a continuation's rows (Q < N) get the bits of the same rows of the
 * whole prompt (Q == N): the same key blocks in the same order, the keys past a row weighing 0.
 *
 * Layouts (strides in elements, head dim contiguous):
 *   q [B, H, Q, D], k and v [B, KVH, N, D] bfloat16, Q <= N (GQA: head h reads KV head h / (H / KVH))
 *   out [B, Q, H, D] bfloat16, contiguous.   D % 32 == 0, D <= 256.
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

#include "prefill_attention_isa.h"
#include "qhf_entry_points.h"

#define QB 16      /* query positions per task */
#define KB 64      /* keys per block: 4 vectors of 16 scores */
#define D_MAX 256  /* head dim bound: the accumulators of one task */
#define ROWS 4     /* rows per micro-kernel */

#ifdef __AVX512BF16__
/* ---- vdpbf16ps: K and V stay bf16, in pairs; the softmax weights are bf16 pairs ---------------- */
typedef uint32_t packed_t; /* two bf16 */
typedef uint16_t weight_t;
typedef const uint16_t *query_row;
#define PACKED_PER_ELEMENT 1 /* K then V: Lp * D / 2 words each */

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

static inline query_row query_at(const uint16_t *q, float *unused, int64_t D) { (void)unused, (void)D; return q; }

static inline uint32_t pair_at(const uint16_t *row, int64_t index) {
    uint32_t pair;
    memcpy(&pair, row + index, sizeof pair);
    return pair;
}

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

/* s[r][0..KB) = q_r . k_j for ROWS rows and the KB keys from `key0` (unscaled). */
static inline void scores_block(const query_row *q, const uint32_t *kp, int64_t key0, int64_t D, float *s) {
    const int64_t pairs = D / 2;
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < 4; ++t) acc[r][t] = _mm512_setzero_ps();
    const uint32_t *base = kp + key0 / 16 * pairs * 16;
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

/* o[r][d0 .. d0 + 16 VECS) = o * alpha[r] + sum_j p[r][j] v_j[d0 ..] over the KB keys from `key0`, for
 * ROWS rows: VECS (4 or 2) is a constant where it is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void values_chunk(const uint16_t *p, const uint32_t *vp, int64_t key0,
                                                               int64_t D, int64_t d0, const float *alpha, float *o,
                                                               const int VECS) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r]);
        for (int t = 0; t < VECS; ++t) acc[r][t] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + d0 + t * 16), a);
    }
    for (int64_t jp = 0; jp < KB / 2; ++jp) {
        const uint32_t *row = vp + (key0 / 2 + jp) * D + d0;
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
#define VALUE_VECS 4   /* vectors per values_chunk call */
#define VALUE_LANES 16 /* fp32 lanes of one */

/* The weights of 32 keys (a: the first 16, b: the next) rounded to bf16 into p, and as fp32 into *ra, *rb. */
static inline void round_weights(v16 a, v16 b, uint16_t *p, v16 *ra, v16 *rb) {
    const __m512i bits = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    _mm512_storeu_si512(p, bits);
    *ra = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bits)), 16));
    *rb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bits, 1)), 16));
}

/* dst[0..32) = bf16(a), bf16(b) */
static inline void store_bf16_x32(uint16_t *dst, v16 a, v16 b) { _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a)); }

#else
/* ---- fp32 FMAs in vdpbf16ps's order: K, V and Q unpacked to fp32 ------------------------------- */
#ifdef __AVX512F__
#define VW 16 /* fp32 lanes of a vector */
typedef __m512 vec;
#define vec_load _mm512_loadu_ps
#define vec_store _mm512_storeu_ps
#define vec_set1 _mm512_set1_ps
#define vec_mul _mm512_mul_ps
#define vec_fmadd _mm512_fmadd_ps
#define SCORE_VECS 4  /* key vectors per pass of scores_block: all 64 keys */
#define VALUE_VECS 4  /* value vectors per values_chunk */
#else
#define VW 8
typedef __m256 vec;
#define vec_load _mm256_loadu_ps
#define vec_store _mm256_storeu_ps
#define vec_set1 _mm256_set1_ps
#define vec_mul _mm256_mul_ps
#define vec_fmadd _mm256_fmadd_ps
#define SCORE_VECS 2 /* 16 of the 64 keys per pass: ROWS x 2 accumulators (3 measured slower: spills) */
#define VALUE_VECS 2
#endif
typedef float packed_t;
typedef float weight_t;
typedef const float *query_row;
#define PACKED_PER_ELEMENT 2 /* K then V: Lp * D floats each */

/* K of one (batch, KV head) as fp32 [Lp/VW][D][VW]: lane j of vector (group, d) holds k[VW group + j][d];
 * keys from L to Lp (L rounded up to KB) are zeros. */
static void pack_keys(const uint16_t *k, int64_t k_sl, int64_t L, int64_t Lp, int64_t D, float *out) {
    for (int64_t key = 0; key < Lp; ++key)
        for (int64_t d = 0; d < D; ++d) out[(key / VW * D + d) * VW + key % VW] = key < L ? bf16_to_f32(k[key * k_sl + d]) : 0.0f;
}

/* V of one (batch, KV head) as fp32 [Lp][D], zeros past L. */
static void pack_values(const uint16_t *v, int64_t v_sl, int64_t L, int64_t Lp, int64_t D, float *out) {
    for (int64_t key = 0; key < Lp; ++key)
        for (int64_t d = 0; d < D; ++d) out[key * D + d] = key < L ? bf16_to_f32(v[key * v_sl + d]) : 0.0f;
}

/* The query row q in fp32, written to `row`. */
static inline query_row query_at(const uint16_t *q, float *row, int64_t D) {
    for (int64_t d = 0; d < D; ++d) row[d] = bf16_to_f32(q[d]);
    return row;
}

/* s[r][VW t0 .. VW (t0 + VECS)) = q_r . k_j for ROWS rows, keys from `key0` (unscaled): per lane, over
 * the dimension pairs in order, the odd dimension's product and then the even one's (vdpbf16ps's order).
 * VECS is a constant where it is inlined, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void scores_chunk(const query_row *q, const float *kp, int64_t key0, int64_t D,
                                                               int t0, float *s, const int VECS) {
    const float *base = kp + key0 * D + t0 * D * VW;
    vec acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < VECS; ++t) acc[r][t] = vec_set1(0.0f);
    for (int64_t dp = 0; dp < D; dp += 2)
        for (int64_t d = dp + 1; d >= dp; --d) {
            vec kv[4];
            for (int t = 0; t < VECS; ++t) kv[t] = vec_load(base + (t * D + d) * VW);
            for (int r = 0; r < ROWS; ++r) {
                const vec qb = vec_set1(q[r][d]);
                for (int t = 0; t < VECS; ++t) acc[r][t] = vec_fmadd(kv[t], qb, acc[r][t]);
            }
        }
    for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < VECS; ++t) vec_store(s + r * KB + (t0 + t) * VW, acc[r][t]);
}

/* s[r][0..KB) = q_r . k_j for ROWS rows and the KB keys from `key0` (unscaled). */
static inline void scores_block(const query_row *q, const float *kp, int64_t key0, int64_t D, float *s) {
    for (int t0 = 0; t0 < KB / VW; t0 += SCORE_VECS) scores_chunk(q, kp, key0, D, t0, s, SCORE_VECS);
}

/* o[r][d0 .. d0 + VW VECS) = o * alpha[r] + sum_j p[r][j] v_j[d0 ..] over the KB keys from `key0`, for
 * ROWS rows, key 2i + 1 before key 2i (vdpbf16ps's order). VECS is a constant where it is inlined. */
static inline __attribute__((always_inline)) void values_chunk(const float *p, const float *vp, int64_t key0, int64_t D,
                                                               int64_t d0, const float *alpha, float *o, const int VECS) {
    vec acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r) {
        const vec a = vec_set1(alpha[r]);
        for (int t = 0; t < VECS; ++t) acc[r][t] = vec_mul(vec_load(o + r * D + d0 + t * VW), a);
    }
    for (int64_t jp = 0; jp < KB; jp += 2)
        for (int64_t j = jp + 1; j >= jp; --j) {
            const float *row = vp + (key0 + j) * D + d0;
            vec vv[4];
            for (int t = 0; t < VECS; ++t) vv[t] = vec_load(row + t * VW);
            for (int r = 0; r < ROWS; ++r) {
                const vec pb = vec_set1(p[r * KB + j]);
                for (int t = 0; t < VECS; ++t) acc[r][t] = vec_fmadd(vv[t], pb, acc[r][t]);
            }
        }
    for (int r = 0; r < ROWS; ++r)
        for (int t = 0; t < VECS; ++t) vec_store(o + r * D + d0 + t * VW, acc[r][t]);
}
#define VALUE_LANES VW

static inline void round_weights(v16 a, v16 b, float *p, v16 *ra, v16 *rb) {
    *ra = v16_round_bf16(a);
    *rb = v16_round_bf16(b);
    v16_store(p, *ra);
    v16_store(p + 16, *rb);
}

static inline void store_bf16_x32(uint16_t *dst, v16 a, v16 b) {
    float rounded[32];
    v16_store(rounded, v16_round_bf16(a));
    v16_store(rounded + 16, v16_round_bf16(b));
    for (int i = 0; i < 32; ++i) {
        uint32_t bits;
        memcpy(&bits, rounded + i, sizeof bits);
        dst[i] = (uint16_t)(bits >> 16);
    }
}
#endif

/* o[r] = o[r] * alpha[r] + sum_j p[r][j] v_j over the KB keys from `key0`, ROWS rows. */
static inline void values_block(const weight_t *p, const packed_t *vp, int64_t key0, int64_t D, const float *alpha,
                                float *o) {
    const int64_t chunk = VALUE_VECS * VALUE_LANES;
    int64_t d0 = 0;
    for (; d0 + chunk <= D; d0 += chunk) values_chunk(p, vp, key0, D, d0, alpha, o, VALUE_VECS);
    if (d0 < D) values_chunk(p, vp, key0, D, d0, alpha, o, 32 / VALUE_LANES); /* 32 dims left (chunk 64) */
}

/* Online softmax of one row's block of scores: masks keys past `visible_end`, rounds p to bf16 into
 * `p`, updates the row's max `m` and sum `l`, and returns the factor its accumulators take. */
static inline float softmax_block(const float *s, int64_t first_key, int64_t visible_end, float scale, weight_t *p,
                                  float *m, float *l) {
    v16 x[4];
    v16 vmax = v16_set1(-INFINITY);
    for (int t = 0; t < 4; ++t) {
        x[t] = v16_scaled_prefix(s + 16 * t, visible_end - (first_key + 16 * t), scale);
        vmax = v16_max(vmax, x[t]);
    }
    const float block_max = v16_reduce_max(vmax);
    const float m_new = block_max > *m ? block_max : *m;
    const float alpha = m_new == *m ? 1.0f : v16_first(exp16(v16_set1(*m - m_new))); /* the max rarely moves late */
    const v16 vm = v16_set1(m_new);
    v16 sum = v16_set1(0.0f);
    for (int t = 0; t < 4; t += 2) {
        v16 lo, hi;
        round_weights(exp16(v16_sub(x[t], vm)), exp16(v16_sub(x[t + 1], vm)), p + 16 * t, &lo, &hi);
        sum = v16_add(sum, v16_add(lo, hi));
    }
    *l = *l * alpha + v16_reduce_add(sum);
    *m = m_new;
    return alpha;
}

/* One task: the G heads of KV head `kvh` at query rows q0 .. q0 + QB - 1 (those below L); row i is key
 * position `offset` + i (N - Q: 0 for a prompt). */
static void attend_block(const uint16_t *q, int64_t q_sh, int64_t q_sl, int64_t h0, int G, const packed_t *kp,
                         const packed_t *vp, uint16_t *out, int64_t out_sl, int64_t L, int64_t offset, int64_t D,
                         int64_t q0, float scale, float *o, float *qf, float *s, weight_t *p, float *m, float *l,
                         float *alpha) {
    const int rows = G * QB; /* row r: head h0 + r / QB, position q0 + r % QB */
    query_row qrow[G * QB];
    for (int r = 0; r < rows; ++r) {
        int64_t pos = q0 + r % QB;
        if (pos >= L) pos = L - 1; /* a ragged last block computes a real row again, never stored */
        qrow[r] = query_at(q + (h0 + r / QB) * q_sh + pos * q_sl, qf + r * D, D);
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
    }
    memset(o, 0, sizeof(float) * rows * D);
    const int64_t last = offset + (q0 + QB < L ? q0 + QB : L); /* keys 0 .. last - 1 are visible to some row */
    for (int64_t key0 = 0; key0 < last; key0 += KB) {
        for (int r0 = 0; r0 < rows; r0 += ROWS) {
            scores_block(qrow + r0, kp, key0, D, s);
            for (int r = r0; r < r0 + ROWS; ++r) {
                int64_t pos = q0 + r % QB;
                if (pos >= L) pos = L - 1;
                alpha[r - r0] = softmax_block(s + (r - r0) * KB, key0, offset + pos + 1, scale, p + (r - r0) * KB, m + r,
                                              l + r);
            }
            values_block(p, vp, key0, D, alpha, o + r0 * D);
        }
    }
    for (int r = 0; r < rows; ++r) {
        const int64_t pos = q0 + r % QB;
        if (pos >= L) continue;
        const v16 inv = v16_set1(1.0f / l[r]);
        uint16_t *dst = out + pos * out_sl + (h0 + r / QB) * D;
        for (int64_t d = 0; d < D; d += 32)
            store_bf16_x32(dst + d, v16_mul(v16_load(o + r * D + d), inv), v16_mul(v16_load(o + r * D + d + 16), inv));
    }
}

int qhf_prefill_attention(const void *q_, int64_t q_sb, int64_t q_sh, int64_t q_sl, const void *k_, int64_t k_sb,
                          int64_t k_sh, int64_t k_sl, const void *v_, int64_t v_sb, int64_t v_sh, int64_t v_sl, void *out_,
                          int64_t B, int64_t H, int64_t KVH, int64_t L, int64_t N, int64_t D, float scale, int n_threads) {
    if (B <= 0 || L <= 0 || N < L || KVH <= 0 || H % KVH != 0 || D % 32 != 0 || D > D_MAX || H / KVH > 64) return 2;
    const uint16_t *q = q_, *k = k_, *v = v_;
    uint16_t *out = out_;
    const int G = (int)(H / KVH);
    const int64_t Lp = (N + KB - 1) / KB * KB, per_head = Lp * D * PACKED_PER_ELEMENT; /* K, then V */
    const int64_t heads = B * KVH, blocks = (L + QB - 1) / QB;
    packed_t *packed = malloc(sizeof(packed_t) * heads * per_head);
    if (!packed) return 1;
    if (n_threads < 1) n_threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(n_threads) reduction(| : failed)
    {
        const unsigned saved_csr = prefill_flush_denormals();
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < heads; ++bh) {
            const int64_t b = bh / KVH, kvh = bh % KVH;
            packed_t *kp = packed + bh * per_head;
            pack_keys(k + b * k_sb + kvh * k_sh, k_sl, N, Lp, D, kp);
            pack_values(v + b * v_sb + kvh * v_sh, v_sl, N, Lp, D, kp + per_head / 2);
        } /* (the loop's barrier: every head is packed before any task reads one) */
        const int rows = G * QB;
        float *scratch = malloc(sizeof(float) * (2 * (size_t)rows * D + ROWS * KB + 2 * (size_t)rows + ROWS));
        weight_t *p = malloc(sizeof(weight_t) * ROWS * KB);
        if (!scratch || !p) failed = 1;
        float *o = scratch, *qf = o + (size_t)rows * D, *s = qf + (size_t)rows * D, *m = s + ROWS * KB, *l = m + rows;
        float *alpha = l + rows;
        /* longest tasks first (the last query blocks see the most keys), handed out one at a time */
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < heads * blocks; ++task) {
            if (!scratch || !p) continue;
            const int64_t block = blocks - 1 - task / heads, bh = task % heads;
            const int64_t b = bh / KVH, kvh = bh % KVH;
            const packed_t *kp = packed + bh * per_head, *vp = kp + per_head / 2;
            attend_block(q + b * q_sb, q_sh, q_sl, kvh * G, G, kp, vp, out + b * L * H * D, H * D, L, N - L, D, block * QB,
                         scale, o, qf, s, p, m, l, alpha);
        }
        free(scratch);
        free(p);
        _mm_setcsr(saved_csr);
    }
    free(packed);
    return failed ? 1 : 0;
}
