/* Part of rowstable_attention.c (included once, after its helpers): up to HEADS_MAX query heads of one
 * KV head computed together on AVX2 or AVX-512. Uses from the includer: Problem, LANES, load16 / load8,
 * element, visible_keys, softmax_numerators and store_row; defines HEADS_MAX and attend_heads. */
#ifndef QHF_ROWSTABLE_ATTENTION_HEADS_H
#define QHF_ROWSTABLE_ATTENTION_HEADS_H

#define HEADS_MAX 6 /* query heads of one kv head computed together (their accumulators fit the registers) */
#define ALWAYS_INLINE inline __attribute__((always_inline))

/* acc[r] = dot_row's 16 lanes (AVX-512) or its lo / hi halves (AVX2) of q row r and the key row at
 * `off`, for R rows: the key row is loaded and widened once for all R. */
#ifdef __AVX512F__
static ALWAYS_INLINE void key_lanes(__m512 *acc, const float *rows, int64_t D, const void *k, int64_t off, int dtype,
                                    const int R) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += LANES) {
        const __m512 kd = load16(k, off + d, dtype);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(rows + r * D + d), kd, acc[r]);
    }
}

/* key_lanes of 4 key rows (offsets off[0..3]) at once: acc[j * HEADS_MAX + r] for key j, row r. Four
 * independent chains per row, and each query vector is loaded once for the four keys. */
static ALWAYS_INLINE void key_lanes4(__m512 *acc, const float *rows, int64_t D, const void *k, const int64_t *off,
                                     int dtype, const int R) {
    for (int j = 0; j < 4; ++j)
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) acc[j * HEADS_MAX + r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += LANES) {
        __m512 kd[4];
        for (int j = 0; j < 4; ++j) kd[j] = load16(k, off[j] + d, dtype);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            const __m512 qd = _mm512_loadu_ps(rows + r * D + d);
            for (int j = 0; j < 4; ++j) acc[j * HEADS_MAX + r] = _mm512_fmadd_ps(qd, kd[j], acc[j * HEADS_MAX + r]);
        }
    }
}
#else
static ALWAYS_INLINE void key_lanes(__m256 *lo, __m256 *hi, const float *rows, int64_t D, const void *k, int64_t off,
                                    int dtype, const int R) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += LANES) {
        const __m256 k_lo = load8(k, off + d, dtype), k_hi = load8(k, off + d + 8, dtype);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) {
            lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(rows + r * D + d), k_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(rows + r * D + d + 8), k_hi, hi[r]);
        }
    }
}
#endif

/* scores[r * N + t] = dot_row(q row r, key t) * scale for R query rows: dot_row's lanes and tree. Keys
 * go in blocks of one vector's width whose trees are reduced together (tree16_x16, tree_sum_halves_x8:
 * the same additions), the rest one at a time. */
static ALWAYS_INLINE void dot_rows(float *scores, int64_t N, const float *rows, int64_t D, const void *k, int64_t k_base,
                                   int64_t k_sn, const int32_t *keys, int64_t count, float scale, int dtype, const int R) {
    int64_t t = 0;
#ifdef __AVX512F__
    const __m512 vscale = _mm512_set1_ps(scale);
    for (; t + LANES <= count; t += LANES) {
        __m512 pairs[HEADS_MAX][LANES / 2];
        for (int u = 0; u < LANES; u += 4) {
            __m512 acc[4 * HEADS_MAX];
            int64_t off[4];
            for (int j = 0; j < 4; ++j) off[j] = k_base + keys[t + u + j] * k_sn;
            key_lanes4(acc, rows, D, k, off, dtype, R);
#pragma GCC unroll 6
            for (int r = 0; r < R; ++r) {
                pairs[r][u / 2] = tree16_pair(acc[r], acc[HEADS_MAX + r]);
                pairs[r][u / 2 + 1] = tree16_pair(acc[2 * HEADS_MAX + r], acc[3 * HEADS_MAX + r]);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores + r * N + t, _mm512_mul_ps(tree16_x16(pairs[r]), vscale));
    }
    for (; t < count; ++t) {
        __m512 acc[HEADS_MAX];
        key_lanes(acc, rows, D, k, k_base + keys[t] * k_sn, dtype, R);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) scores[r * N + t] = tree_sum16(acc[r]) * scale;
    }
#else
    const __m256 vscale = _mm256_set1_ps(scale);
    for (; t + 8 <= count; t += 8) {
        __m256 s8[HEADS_MAX][8]; /* the tree's first step, lo + hi, of each key */
        for (int u = 0; u < 8; ++u) {
            __m256 lo[HEADS_MAX], hi[HEADS_MAX];
            key_lanes(lo, hi, rows, D, k, k_base + keys[t + u] * k_sn, dtype, R);
#pragma GCC unroll 6
            for (int r = 0; r < R; ++r) s8[r][u] = _mm256_add_ps(lo[r], hi[r]);
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(scores + r * N + t, _mm256_mul_ps(tree_sum_halves_x8(s8[r]), vscale));
    }
    for (; t < count; ++t) {
        __m256 lo[HEADS_MAX], hi[HEADS_MAX];
        key_lanes(lo, hi, rows, D, k, k_base + keys[t] * k_sn, dtype, R);
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r) scores[r * N + t] = tree_sum_halves(lo[r], hi[r]) * scale;
    }
#endif
}

/* out[r * D + d] = sum_t p[r * N + t] * v[keys[t]][d] for R rows: per element, fused multiply-adds in t
 * order from 0.0f, as weighted_sum; each value row loaded once for all R. The elements go in slices
 * of SLICE, whose R * SLICE / VEC accumulators stay in registers (weighted_sums passes R <= 6 on
 * AVX-512: 24 of 32 registers; R <= 3 on AVX2: 12 of 16). */
#ifdef __AVX512F__
#define VEC 16
#define SLICE 64
typedef __m512 vec_t;
#define VEC_ZERO() _mm512_setzero_ps()
#define VEC_AXPY(acc, p, x) _mm512_fmadd_ps(_mm512_set1_ps(p), x, acc)
#define VEC_LOAD(base, off, dtype) load16(base, off, dtype)
#define VEC_STORE(ptr, x) _mm512_storeu_ps(ptr, x)
#else
#define VEC 8
#define SLICE 32
typedef __m256 vec_t;
#define VEC_ZERO() _mm256_setzero_ps()
#define VEC_AXPY(acc, p, x) _mm256_fmadd_ps(_mm256_set1_ps(p), x, acc)
#define VEC_LOAD(base, off, dtype) load8(base, off, dtype)
#define VEC_STORE(ptr, x) _mm256_storeu_ps(ptr, x)
#endif

static ALWAYS_INLINE void weighted_sums_block(float *out, int64_t D, const float *p, int64_t N, const void *v, int64_t v_base,
                                              int64_t v_sn, const int32_t *keys, int64_t count, int dtype, const int R) {
    for (int64_t s = 0; s < D; s += SLICE) {
        vec_t acc[HEADS_MAX][SLICE / VEC];
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < SLICE / VEC; ++c) acc[r][c] = VEC_ZERO();
        for (int64_t t = 0; t < count; ++t) {
            const int64_t off = v_base + keys[t] * v_sn + s;
            for (int c = 0; c < SLICE / VEC; ++c) {
                const vec_t x = VEC_LOAD(v, off + c * VEC, dtype);
#pragma GCC unroll 6
                for (int r = 0; r < R; ++r) acc[r][c] = VEC_AXPY(acc[r][c], p[r * N + t], x);
            }
        }
#pragma GCC unroll 6
        for (int r = 0; r < R; ++r)
            for (int c = 0; c < SLICE / VEC; ++c) VEC_STORE(out + r * D + s + c * VEC, acc[r][c]);
    }
}

static ALWAYS_INLINE void weighted_sums(float *out, int64_t D, const float *p, int64_t N, const void *v, int64_t v_base,
                                        int64_t v_sn, const int32_t *keys, int64_t count, int dtype, const int R) {
    const int block = VEC == 16 ? 6 : 3; /* AVX2's 16 registers: 3 rows x 4 accumulators */
    for (int r0 = 0; r0 < R; r0 += block) {
        const int rows = R - r0 < block ? R - r0 : block;
        float *o = out + r0 * D;
        const float *pr = p + r0 * N;
        if (rows >= 6) weighted_sums_block(o, D, pr, N, v, v_base, v_sn, keys, count, dtype, 6);
        else if (rows == 5) weighted_sums_block(o, D, pr, N, v, v_base, v_sn, keys, count, dtype, 5);
        else if (rows == 4) weighted_sums_block(o, D, pr, N, v, v_base, v_sn, keys, count, dtype, 4);
        else if (rows == 3) weighted_sums_block(o, D, pr, N, v, v_base, v_sn, keys, count, dtype, 3);
        else if (rows == 2) weighted_sums_block(o, D, pr, N, v, v_base, v_sn, keys, count, dtype, 2);
        else weighted_sums_block(o, D, pr, N, v, v_base, v_sn, keys, count, dtype, 1);
    }
}

/* Heads h0 .. h0 + R - 1 (one kv head's, so the same visible keys) at query row i, batch b, together:
 * each key and value row is loaded and widened once for the R rows, and each row's arithmetic is
 * attend_row's operation for operation (the same lanes, tree and key order), so its bits are the same.
 * D % 64 == 0. R is a constant where this is inlined (attend_heads), so the accumulators stay in
 * registers. scratch: R * N scores, N key indices, R * D floats. */
static ALWAYS_INLINE void attend_heads_r(const Problem *P, int64_t b, int64_t h0, int64_t i, float *scratch, const int R,
                                          const int64_t D) {
    const int64_t N = P->N, kvh = h0 / P->group;
    float *scores = scratch;                     /* [R][N] */
    int32_t *keys = (int32_t *)(scores + R * N); /* [N] */
    float *rows = (float *)(keys + N);           /* [R][D]: the query rows, then their outputs */
    for (int r = 0; r < R; ++r) {
        const int64_t q_off = b * P->q_sb + (h0 + r) * P->q_sh + i * P->q_sq;
        for (int64_t d = 0; d < D; ++d) rows[r * D + d] = element(P->q, q_off, d, P->dtype);
    }
    const uint8_t *mask_row = P->mask ? P->mask + b * P->m_sb + i * P->m_sq : NULL;
    const int64_t end = P->mask ? N : N - P->Q + i + 1;
    const int64_t k_base = b * P->k_sb + kvh * P->k_sh, v_base = b * P->v_sb + kvh * P->v_sh;
    const int64_t count = visible_keys(mask_row, end, keys);
    dot_rows(scores, N, rows, D, P->k, k_base, P->k_sn, keys, count, P->scale, P->dtype, R);
    float inv[HEADS_MAX] = {0};
    for (int r = 0; r < R && count; ++r) inv[r] = 1.0f / softmax_numerators(scores + r * N, count);
    weighted_sums(rows, D, scores, N, P->v, v_base, P->v_sn, keys, count, P->dtype, R); /* zeros when count == 0 */
    for (int r = 0; r < R; ++r) store_row(P, b, h0 + r, i, rows + r * D, inv[r]);
}

/* R and the head size as constants where they are inlined: D = 64 (Llama, Qwen2) gets its loops unrolled. */
static void attend_heads_d(const Problem *P, int64_t b, int64_t h0, int R, int64_t i, float *scratch, const int64_t D) {
    switch (R) {
    case 1: attend_heads_r(P, b, h0, i, scratch, 1, D); break;
    case 2: attend_heads_r(P, b, h0, i, scratch, 2, D); break;
    case 3: attend_heads_r(P, b, h0, i, scratch, 3, D); break;
    case 4: attend_heads_r(P, b, h0, i, scratch, 4, D); break;
    case 5: attend_heads_r(P, b, h0, i, scratch, 5, D); break;
    default: attend_heads_r(P, b, h0, i, scratch, 6, D); break;
    }
}

static void attend_heads(const Problem *P, int64_t b, int64_t h0, int R, int64_t i, float *scratch) {
#ifdef __AVX512F__
    if (P->D == 64) {
        attend_heads_d(P, b, h0, R, i, scratch, 64);
        return;
    }
#endif
    attend_heads_d(P, b, h0, R, i, scratch, P->D);
}

#endif
