/* Shared by csrc/hadamard_rows.c (portable), csrc/hadamard_rows_avx2.c and csrc/hadamard_rows_avx512.c:
 * the scalar butterflies and +-1 mix (the order `rotate_rows_reference` defines), and the entry point
 * over rows, which calls the including file's `rotate_row`. Its text is part of every kernel's build key
 * in c_build.py. */
#ifndef QHF_HADAMARD_ROWS_H
#define QHF_HADAMARD_ROWS_H
#include "qhf_common.h"
#include "qhf_entry_points.h"
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static void rotate_row(const void *x, int dtype, float *z, float *out, int64_t blocks, int64_t m, int64_t n,
                       const float *signs, float scale);

static void load_row(const void *x, int dtype, float *z, int64_t K) {
    for (int64_t k = 0; k < K; k++)
        z[k] = dtype == 0 ? ((const float *)x)[k] : bf16_to_f32(((const uint16_t *)x)[k]);
}

static void butterflies_scalar(float *z, int64_t n) {
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                float a = z[j], b = z[j + h];
                z[j] = a + b;
                z[j + h] = a - b;
            }
}

/* y = H_m^T z (per column q) for one block: 4 output rows x QB columns stay in registers while
 * p' runs; m is a multiple of 4 (a Paley order). Same per-element order as the plain loop. */
#define QB 16
static void mix_block_scalar(const float *zc, float *yc, int64_t m, int64_t n, const float *signs, float scale) {
    for (int64_t p = 0; p < m; p += 4) {
        for (int64_t q0 = 0; q0 < n; q0 += QB) {
            const int64_t width = n - q0 < QB ? n - q0 : QB;
            float acc[4][QB];
            for (int i = 0; i < 4; i++)
                for (int64_t q = 0; q < width; q++) acc[i][q] = signs[p + i] * zc[q0 + q];
            for (int64_t pp = 1; pp < m; pp++) {
                const float *zp = zc + pp * n + q0;
                for (int i = 0; i < 4; i++) {
                    const float s = signs[pp * m + p + i];
                    if (width == QB)
                        for (int q = 0; q < QB; q++) acc[i][q] = acc[i][q] + s * zp[q];
                    else
                        for (int64_t q = 0; q < width; q++) acc[i][q] = acc[i][q] + s * zp[q];
                }
            }
            for (int i = 0; i < 4; i++)
                for (int64_t q = 0; q < width; q++) yc[(p + i) * n + q0 + q] = acc[i][q] * scale;
        }
    }
}

/* One row x (K = blocks * m * n) -> out: load into z, butterflies per Sylvester block, then the +-1 mix
 * (m > 1) or the scaling (m = 1). A build passes its vector butterflies for blocks whose n is a
 * multiple of `width` and its vector mix (also m % 4 == 0); width 0 (the portable build) or other
 * shapes take the scalar loops. Every path computes the same bits. */
typedef void (*butterflies_fn)(float *z, int64_t n);
typedef void (*mix_fn)(const float *zc, float *yc, int64_t m, int64_t n, const float *signs, float scale);
static inline void rotate_row_using(const void *x, int dtype, float *z, float *out, int64_t blocks, int64_t m,
                                    int64_t n, const float *signs, float scale, int64_t width,
                                    butterflies_fn butterflies, mix_fn mix) {
    const int64_t K = blocks * m * n;
    load_row(x, dtype, z, K);
    const int vector = width > 0 && n % width == 0;
    for (int64_t g = 0; g < blocks * m; g++) {
        if (vector)
            butterflies(z + g * n, n);
        else
            butterflies_scalar(z + g * n, n);
    }
    if (m == 1) {
        for (int64_t k = 0; k < K; k++) out[k] = z[k] * scale;
        return;
    }
    for (int64_t c = 0; c < blocks; c++) {
        if (vector && m % 4 == 0)
            mix(z + c * m * n, out + c * m * n, m, n, signs, scale);
        else
            mix_block_scalar(z + c * m * n, out + c * m * n, m, n, signs, scale);
    }
}

int qhf_hadamard_rows(const void *x, int64_t x_stride, int64_t rows, int dtype, float *out, int64_t blocks, int64_t m,
                      int64_t n, const float *signs, float scale, int threads) {
    const int64_t K = blocks * m * n;
    const int64_t elem = dtype == 0 ? 4 : 2;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel if (threads > 1) num_threads(threads > 0 ? threads : 1) reduction(| : failed)
#endif
    {
        float *z = (float *)malloc((size_t)K * sizeof(float)); /* each thread's own scratch row */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < rows; r++) {
            if (z)
                rotate_row((const char *)x + r * x_stride * elem, dtype, z, out + r * K, blocks, m, n, signs, scale);
            else
                failed = 1;
        }
        free(z);
    }
    (void)threads;
    return failed;
}

#endif
